// generate: text (or token ids) from a Hugging Face Llama / Mistral directory
// with the KV-cached decoder of shardtrain::models.
//
//   build/bin/generate --model-dir DIR --prompt "The capital of France is" --max-new-tokens 32
//   build/bin/generate --model-dir DIR --prompt-ids 1,415,5565 --print-ids        # compare ids with transformers
//   build/bin/generate --model-dir DIR --chat-format llama2 --prompts-jsonl eval.jsonl --limit 6
//   build/bin/shardtrain launch --num_processes 2 build/bin/generate --config configs/zero3_fp32.json
//       --model-dir DIR --prompt "..."                                             # sharded (ZeRO-3 / FSDP)
//
// --prompt is tokenized with DIR/tokenizer.model (or --tokenizer) and BOS
// (config.json's bos_token_id) is prepended; --prompt-ids are used as given.
// Generation stops after the eos ids of generation_config.json, else of
// config.json, any of them when several are listed, as transformers'
// generate() does (unless --ignore-eos). Sampling (--temperature, --top-k
// default 50, --top-p) follows transformers' warpers; a generation_config.json
// that samples sets the defaults.
//
// --chat-format llama2|mistral formats the prompt exactly as the fine-tune's
// training prefix (models::format_prompt: "<s>[INST] prompt [/INST]", single
// turn, no system prompt), so a fine-tuned export answers as it was trained.
// --prompts-jsonl continues every {"prompt","response"} record of a file and
// shows the expected response next to the answer.
#include <chrono>
#include <filesystem>
#include <iostream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "shardtrain/accelerator.h"
#include "shardtrain/comm/rendezvous.h"
#include "shardtrain/device.h"
#include "shardtrain/error.h"
#include "shardtrain/lora.h"
#include "shardtrain/models/generation.h"
#include "shardtrain/models/instruction_data.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/tokenizer.h"

namespace fs = std::filesystem;
namespace sm = shardtrain::models;

namespace {

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto first = item.find_first_not_of(" \t");
    const auto last = item.find_last_not_of(" \t");
    ST_CHECK_T(shardtrain::ConfigError, first != std::string::npos, "--prompt-ids '", text, "' has an empty entry");
    item = item.substr(first, last - first + 1);
    std::size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    ST_CHECK_T(shardtrain::ConfigError, used == item.size() && id >= 0, "--prompt-ids: '", item,
               "' is not a token id (expected comma-separated non-negative integers)");
    ids.push_back(id);
  }
  ST_CHECK_T(shardtrain::ConfigError, !ids.empty(), "--prompt-ids is empty");
  return ids;
}

std::string join_ids(const std::vector<int64_t>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"generate: KV-cached text generation with a Hugging Face Llama / Mistral model"};
  std::string model_dir, tokenizer_path, prompt, prompt_ids_text, chat_format = "none", dtype = "fp32", config_path,
              device_name = "auto";
  sm::GenerationOptions options;
  options.max_new_tokens = 64;
  bool print_ids = false, ignore_eos = false, no_bos = false;
  app.add_option("--model-dir", model_dir, "Hugging Face model directory (config.json + model.safetensors or shards)")
      ->required();
  std::string lora_adapter;
  app.add_option("--lora-adapter", lora_adapter,
                 "A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) applied to the model");
  app.add_option("--tokenizer", tokenizer_path, "sentencepiece model (default: MODEL_DIR/tokenizer.model)");
  auto* text_opt = app.add_option("--prompt", prompt, "Prompt text (tokenized; BOS prepended)");
  auto* ids_opt = app.add_option("--prompt-ids", prompt_ids_text, "Prompt token ids, comma-separated, used as given");
  std::string prompts_jsonl;
  int64_t limit = 0;
  auto* file_opt = app.add_option("--prompts-jsonl", prompts_jsonl,
                                  "Continue each {\"prompt\"} record of this JSONL file (shown with its \"response\")");
  app.add_option("--limit", limit, "With --prompts-jsonl: the first N records (0: all)")->capture_default_str();
  text_opt->excludes(ids_opt)->excludes(file_opt);
  ids_opt->excludes(file_opt);
  app.add_option("--max-new-tokens", options.max_new_tokens, "Tokens to generate at most")->capture_default_str();
  auto* temperature_opt = app.add_option("--temperature", options.temperature,
                                         "0: greedy; otherwise sampling temperature (default: greedy, or the "
                                         "model's generation_config.json when it samples)");
  auto* top_k_opt = app.add_option("--top-k", options.top_k,
                                   "Sampling among the K most probable tokens (0: all; transformers' default 50)")
                        ->capture_default_str();
  auto* top_p_opt = app.add_option("--top-p", options.top_p, "Nucleus sampling mass in (0, 1]")->capture_default_str();
  app.add_option("--seed", options.seed, "Sampling seed")->capture_default_str();
  app.add_option("--device", device_name,
                 "cpu, cuda (cuda:LOCAL_RANK), cuda:N or auto (a GPU when visible); with --config the backend "
                 "follows the device")
      ->capture_default_str();
  app.add_flag("--print-ids", print_ids, "Print the generated token ids comma-separated instead of text");
  app.add_flag("--ignore-eos", ignore_eos, "Do not stop at the eos ids (generation_config.json's, else config.json's)");
  app.add_flag("--no-bos", no_bos, "Do not prepend BOS to --prompt");
  app.add_option("--chat-format", chat_format,
                 "Format --prompt as the fine-tune's training prefix (llama2, mistral: '<s>[INST] prompt [/INST]')")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "llama2", "mistral"}));
  app.add_option("--dtype", dtype, "Compute dtype of the weights")->capture_default_str()->check(
      CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--config", config_path,
                 "Accelerate YAML / DeepSpeed JSON: shard the model with it (run under `shardtrain launch`)");
  CLI11_PARSE(app, argc, argv);

  try {
    ST_CHECK_T(shardtrain::ConfigError, text_opt->count() + ids_opt->count() + file_opt->count() == 1,
               "give the prompt with --prompt TEXT, --prompt-ids 1,2,3 or --prompts-jsonl FILE");
    ST_CHECK_T(shardtrain::ConfigError, fs::is_directory(model_dir), "model directory '", model_dir,
               "' does not exist");
    const fs::path config_file = fs::path(model_dir) / "config.json";
    ST_CHECK_T(shardtrain::ConfigError, fs::exists(config_file), "no config.json in '", model_dir,
               "' (expected a Hugging Face model directory)");
    const sm::LlamaConfig config = sm::LlamaConfig::from_json_file(config_file.string());
    if (tokenizer_path.empty()) tokenizer_path = (fs::path(model_dir) / "tokenizer.model").string();

    // The tokenizer is needed to read --prompt and to print text.
    std::unique_ptr<shardtrain::Tokenizer> tokenizer;
    if (text_opt->count() > 0 || file_opt->count() > 0 || !print_ids) {
      ST_CHECK_T(shardtrain::ConfigError, fs::exists(tokenizer_path), "no tokenizer at '", tokenizer_path,
                 "' (give --tokenizer, or --prompt-ids with --print-ids to work on token ids only)");
      tokenizer = shardtrain::load_sentencepiece(tokenizer_path);
    }
    // Each prompt as ids, with the text and expected answer to show next to it.
    struct Prompt {
      std::vector<int64_t> ids;
      std::string text, expected;
    };
    std::vector<Prompt> prompts;
    auto tokenize = [&](const std::string& text) {
      std::vector<int64_t> ids;
      if (chat_format != "none") {
        // Exactly the prefix the fine-tune trained on (instruction_data.h).
        ids = sm::format_prompt(*tokenizer, sm::parse_chat_format(chat_format), text);
        if (no_bos && !ids.empty() && ids.front() == tokenizer->bos_id()) ids.erase(ids.begin());
      } else {
        if (!no_bos) ids.push_back(config.bos_token_id);
        for (int64_t id : tokenizer->encode(text)) ids.push_back(id);
      }
      ST_CHECK_T(shardtrain::ConfigError, !ids.empty(), "the prompt '", text, "' tokenized to nothing");
      return ids;
    };
    if (text_opt->count() > 0) {
      prompts.push_back({tokenize(prompt), prompt, ""});
    } else if (file_opt->count() > 0) {
      for (const auto& record : sm::read_instruction_jsonl(prompts_jsonl)) {
        if (record.format != sm::RecordFormat::kInstruction) continue;
        if (limit > 0 && static_cast<int64_t>(prompts.size()) >= limit) break;
        prompts.push_back({tokenize(record.prompt), record.prompt, record.response});
      }
      ST_CHECK_T(shardtrain::ConfigError, !prompts.empty(), prompts_jsonl, " has no {\"prompt\", \"response\"} records");
    } else {
      prompts.push_back({parse_ids(prompt_ids_text), "", ""});
    }
    for (const auto& p : prompts) {
      for (int64_t id : p.ids) {
        ST_CHECK_T(shardtrain::ConfigError, id < config.vocab_size, "prompt token id ", id,
                   " is outside the model's vocabulary (vocab_size ", config.vocab_size, ")");
      }
    }
    // generation_config.json's settings are the defaults, as transformers'
    // generate() takes them: its eos ids (Llama 3 instruct lists its
    // end-of-turn id there only) and, when it samples, its sampling values;
    // the flags given override them.
    const std::optional<sm::GenerationConfigFile> generation_config = sm::read_generation_config(model_dir);
    if (generation_config && generation_config->do_sample && temperature_opt->count() == 0) {
      options.temperature = generation_config->temperature.value_or(1.0);
    }
    if (generation_config && options.temperature > 0.0) {
      if (top_k_opt->count() == 0 && generation_config->top_k) options.top_k = *generation_config->top_k;
      if (top_p_opt->count() == 0 && generation_config->top_p) options.top_p = *generation_config->top_p;
      std::cerr << "sampling with " << model_dir << "/generation_config.json's defaults under the flags given: "
                << "temperature " << options.temperature << ", top_k " << options.top_k << ", top_p "
                << options.top_p << " (--temperature 0: greedy)" << std::endl;
    }
    if (options.temperature == 0.0 && (top_k_opt->count() > 0 || top_p_opt->count() > 0)) {
      std::cerr << "warning: --top-k and --top-p shape sampling only; without --temperature the decoding is greedy"
                << std::endl;
    }
    if (!ignore_eos) {
      if (generation_config && !generation_config->eos_token_ids.empty()) {
        options.stop_ids = generation_config->eos_token_ids;
      } else {
        options.stop_ids = {config.eos_token_id};
        options.stop_ids.insert(options.stop_ids.end(), config.other_eos_token_ids.begin(),
                                config.other_eos_token_ids.end());
      }
    }
    for (const auto& p : prompts) {
      const int64_t length = static_cast<int64_t>(p.ids.size()) + options.max_new_tokens;
      if (length > config.max_position_embeddings) {
        std::cerr << "warning: prompt and new tokens reach " << length << " positions, past the model's "
                  << "max_position_embeddings (" << config.max_position_embeddings
                  << "); what comes after may be degenerate" << std::endl;
        break;
      }
    }

    const at::Device device = shardtrain::resolve_device(device_name, shardtrain::detect_dist_env().local_rank);
    sm::LlamaForCausalLM model(config);
    if (dtype == "bf16") model->to(at::kBFloat16);
    sm::load_hf_weights(model, model_dir);
    if (!lora_adapter.empty()) {
      // PEFT's PeftModel.from_pretrained(base, adapter): the adapters stay
      // fp32 on a bf16 base, as PEFT keeps them.
      shardtrain::LoraSummary adapters;
      shardtrain::load_lora_adapter(*model, lora_adapter, &adapters);
      std::cerr << "LoRA adapter " << lora_adapter << " on " << adapters.adapted_modules.size() << " layers"
                << std::endl;
      if (!adapters.unmatched_targets.empty()) std::cerr << "warning: " << adapters.describe_unmatched() << std::endl;
    }
    model->to(device);
    model->eval();
    torch::NoGradGuard no_grad;

    const auto started = std::chrono::steady_clock::now();
    bool main_process = true;
    std::function<sm::GenerationResult(const std::vector<int64_t>&)> run_one;
    std::unique_ptr<shardtrain::Accelerator> accelerator;
    std::optional<shardtrain::PreparedModel<sm::LlamaForCausalLM>> prepared;
    if (!config_path.empty()) {
      shardtrain::AcceleratorOptions accelerator_options;
      accelerator_options.config_path = config_path;
      accelerator_options.init.backend = shardtrain::backend_for(device);
      accelerator = std::make_unique<shardtrain::Accelerator>(accelerator_options);
      main_process = accelerator->is_main_process();
      // SGD without momentum: the engine then allocates no optimizer state.
      // (A bf16 model under FSDP is pure low precision, which only runs Adam:
      // it keeps the default optimizer there.)
      shardtrain::OptimizerOptions inference;
      if (dtype == "fp32") {
        inference.type = "SGD";
        inference.momentum = 0.0;
      }
      shardtrain::RunInfo run;  // what the config's "auto" values resolve from
      run.hidden_size = config.hidden_size;
      run.micro_batch_size = 1;
      run.load_dtype = dtype;
      prepared.emplace(accelerator->prepare(model, inference, run));
      // Every forward is collective: all ranks continue with rank 0's token,
      // so they take the same number of steps.
      options.agree_on_token = [&accelerator](int64_t token) {
        at::Tensor t = at::full({1}, token, at::TensorOptions().dtype(at::kLong).device(accelerator->device()));
        accelerator->communicator().broadcast(t, 0);
        return t.item<int64_t>();
      };
      run_one = [&](const std::vector<int64_t>& ids) {
        return sm::generate(sm::prepared_cached_step(*prepared), ids, options);
      };
    } else {
      run_one = [&](const std::vector<int64_t>& ids) { return sm::generate(sm::cached_step(model), ids, options); };
    }

    int64_t generated = 0;
    for (const auto& p : prompts) {
      const sm::GenerationResult result = run_one(p.ids);
      generated += static_cast<int64_t>(result.tokens.size());
      if (!main_process) continue;
      const std::string output = print_ids ? join_ids(result.tokens) : tokenizer->decode(result.tokens);
      if (file_opt->count() > 0) {
        std::cout << p.text << "  =>  " << output << "   (expected: " << p.expected << ")" << std::endl;
      } else {
        std::cout << output << std::endl;
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (main_process) {
      std::cerr << "generate: " << generated << " tokens for " << prompts.size() << " prompt(s) in " << seconds
                << " s" << std::endl;
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "generate: " << e.what() << std::endl;
    return 1;
  }
}
