# SPDX-License-Identifier: Apache-2.0
"""Write a tiny random Llama and a locally trained tokenizer to a directory (no model hub).

Run with the vLLM test environment's Python: ``python vllm_tiny_model.py OUT_DIR [HIDDEN
LAYERS]``.
Shapes suit vLLM's CPU attention: head_dim 32 (its smallest supported size), 2 layers,
hidden 128, 4 query and 2 KV heads, fp32.
"""
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 512


def corpus():
    words = ("prefill decode block cache layer token engine transfer segment region "
             "notify lease batch memory register read write peer handshake").split()
    for i in range(400):
        yield " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12))
        yield " ".join(str((i * 13 + j) % 997) for j in range(16))


def main(out: str, hidden: int = 128, layers: int = 2) -> None:
    """``hidden``, ``layers``: a larger model for benchmarks where prefill must cost
    what it does on real models relative to the rest (head_dim stays 32)."""
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(1234)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=4096)
    fast.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=max(VOCAB, len(fast)), hidden_size=hidden,
                      intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64,
                      head_dim=32, max_position_embeddings=4096,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Random weights at the default scale give near-uniform logits; a wider spread makes
    # greedy decoding depend clearly on the context (so corrupted KV shows).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny llama in {out}: vocab {cfg.vocab_size}, tokenizer {len(fast)}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(v) for v in sys.argv[2:4]))
