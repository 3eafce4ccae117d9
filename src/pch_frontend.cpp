// The translation unit that builds src/pch_frontend.h's precompiled header
// (target shardtrain_frontend_pch), which the frontend targets reuse. It
// compiles nothing of its own.
