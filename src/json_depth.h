#pragma once
// One nesting limit for every JSON document shardtrain reads: configs, a
// model's config.json, checkpoint indexes and safetensors headers. nlohmann
// parses without recursion, but a parsed document is copied, printed, walked
// and destroyed one stack frame per level, so a 90 KB file nested 15,000 deep
// crashed `shardtrain config check` with SIGSEGV. No file shardtrain reads
// nests more than 5 levels; the limit leaves an order of magnitude of room.

#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "shardtrain/error.h"

namespace shardtrain {

/// The deepest nesting of objects and arrays a JSON document may have.
inline constexpr int kMaxJsonDepth = 64;

/// Parses `input` (text or a stream) like Json::parse, refusing a document
/// nested deeper than kMaxJsonDepth with an `ErrorType` that names `what` and
/// the limit. `inner`, when given, sees every parse event as a parser callback
/// does (duplicate-key checks). Syntax errors are Json's exceptions, as from
/// Json::parse, for the caller to word.
template <typename ErrorType, typename Json, typename Input>
Json parse_json_within_depth(Input&& input, const std::string& what,
                             typename Json::parser_callback_t inner = nullptr, bool ignore_comments = false) {
  typename Json::parser_callback_t guard = [&](int depth, typename Json::parse_event_t event, Json& parsed) {
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth) {
      ST_THROW(ErrorType, what, " nests objects and arrays deeper than ", kMaxJsonDepth,
               " levels; no file shardtrain reads needs more than a few, so it is refused as malformed");
    }
    return inner ? inner(depth, event, parsed) : true;
  };
  return Json::parse(std::forward<Input>(input), guard, /*allow_exceptions=*/true, ignore_comments);
}

}  // namespace shardtrain
