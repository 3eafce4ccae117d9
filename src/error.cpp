// The error types are header-only; this unit anchors their vtables in the library.
#include "shardtrain/error.h"
