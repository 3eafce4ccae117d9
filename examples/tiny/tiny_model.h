#pragma once
// train_tiny's model: a small decoder (token + position embedding, a few
// pre-norm transformer blocks marked as sharding units, an LM head). Small
// enough to train on 2 CPU cores in seconds, shaped like the real thing so
// every engine path (units, root parameters, attention, MLP) is exercised.
// Its matrix products go through shardtrain::nn, so bf16 runs at fp32 speed
// on CPUs without native bf16.

#include <cmath>
#include <cstdint>

#include <torch/torch.h>

#include "shardtrain/nn/linear.h"
#include "shardtrain/unit.h"

namespace tiny {

struct TinyConfig {
  int64_t vocab = 256;
  int64_t hidden = 64;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t seq_len = 32;
  int64_t ffn = 256;
  double init_std = 0.02;
};

/// RMSNorm computed in fp32 whatever the activation dtype (as Llama does).
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps = 1e-5) {
  at::Tensor x32 = x.to(at::kFloat);
  at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (normed * weight.to(at::kFloat)).to(x.scalar_type());
}

struct TinyBlockImpl : torch::nn::Module, shardtrain::Unit {
  explicit TinyBlockImpl(const TinyConfig& c)
      : Unit("TinyBlock"), config(c),
        norm1(register_parameter("norm1", torch::ones({c.hidden}))),
        qkv(register_module("qkv", shardtrain::nn::Linear(torch::nn::LinearOptions(c.hidden, 3 * c.hidden).bias(false)))),
        proj(register_module("proj", shardtrain::nn::Linear(torch::nn::LinearOptions(c.hidden, c.hidden).bias(false)))),
        norm2(register_parameter("norm2", torch::ones({c.hidden}))),
        up(register_module("up", shardtrain::nn::Linear(torch::nn::LinearOptions(c.hidden, c.ffn).bias(true)))),
        down(register_module("down", shardtrain::nn::Linear(torch::nn::LinearOptions(c.ffn, c.hidden).bias(true)))) {}

  at::Tensor forward(const at::Tensor& x) {
    return run_unit(x, [this](const at::Tensor& h) {
      at::Tensor attended = h + attention(rms_norm(h, norm1));
      return attended + down(at::gelu(up(rms_norm(attended, norm2))));
    });
  }

  at::Tensor attention(const at::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), H = config.hidden, nh = config.heads, d = H / nh;
    auto parts = qkv(x).view({B, T, 3, nh, d}).permute({2, 0, 3, 1, 4});  // 3,B,nh,T,d
    at::Tensor q = parts[0], k = parts[1], v = parts[2];
    at::Tensor scores = shardtrain::nn::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
    at::Tensor causal = at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
    scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
    at::Tensor probs = at::softmax(scores.to(at::kFloat), -1).to(x.scalar_type());
    at::Tensor out = shardtrain::nn::matmul(probs, v).transpose(1, 2).reshape({B, T, H});
    return proj(out);
  }

  TinyConfig config;
  at::Tensor norm1;
  shardtrain::nn::Linear qkv, proj;
  at::Tensor norm2;
  shardtrain::nn::Linear up, down;
};
TORCH_MODULE(TinyBlock);

struct TinyModelImpl : torch::nn::Module {
  explicit TinyModelImpl(const TinyConfig& c)
      : config(c),
        embed(register_module("embed", torch::nn::Embedding(c.vocab, c.hidden))),
        position(register_module("position", torch::nn::Embedding(c.seq_len, c.hidden))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        norm_f(register_parameter("norm_f", torch::ones({c.hidden}))),
        head(register_module("head", shardtrain::nn::Linear(torch::nn::LinearOptions(c.hidden, c.vocab).bias(false)))) {
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(TinyBlock(c));
    // GPT-style init: normal(0, init_std) for every matrix, zero biases, unit norms.
    torch::NoGradGuard no_grad;
    for (auto& item : named_parameters()) {
      const std::string& name = item.key();
      at::Tensor p = item.value();
      if (name.find("norm") != std::string::npos) p.fill_(1.0);
      else if (name.find("bias") != std::string::npos) p.zero_();
      else p.normal_(0.0, c.init_std);
    }
  }

  /// tokens [B, T] (int64) -> logits [B, T, vocab] (fp32).
  at::Tensor forward(const at::Tensor& tokens) {
    const int64_t T = tokens.size(1);
    at::Tensor positions = at::arange(T, tokens.options());
    at::Tensor h = embed(tokens) + position(positions).unsqueeze(0);
    for (auto& block : *blocks) h = block->as<TinyBlock>()->forward(h);
    return head(rms_norm(h, norm_f)).to(at::kFloat);
  }

  TinyConfig config;
  torch::nn::Embedding embed, position;
  torch::nn::ModuleList blocks;
  at::Tensor norm_f;
  shardtrain::nn::Linear head;
};
TORCH_MODULE(TinyModel);

}  // namespace tiny
