"""Small Hugging Face models the project did not write, random-initialised, each with its training loss.

Every family is built from its transformers configuration (a few layers, hidden 64, vocabulary 128,
dropout 0 so that a sharded run can equal one process with torch's own dropout; `WITH_DROPOUT` drops, against
one process drawing the ranks' masks) and wrapped so that its forward takes
``(inputs, labels)`` and returns the loss: the module a user plans (``torch.onnx.export(module, batch,
dynamo=True)``) and then trains with the plan (`autopar.torch.parallelize`). `batch` draws a seeded
batch for it. The tests and ``bench/train.py`` build their models here; transformers is a test
dependency, not one of autopar's.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

VOCAB = 128
SEQ = 16


class WithLoss(torch.nn.Module):
    """``model(keyword=inputs, labels=labels).loss``: the module's one output is its loss."""

    def __init__(self, model: torch.nn.Module, keyword: str, **options: object) -> None:
        super().__init__()
        self.model = model
        self.keyword = keyword
        self.options = options

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.keyword: inputs}, labels=labels, **self.options).loss


@dataclass(frozen=True)
class Family:
    """How to build one family's module and a batch for it."""

    name: str
    build: Callable[[int], torch.nn.Module]  # layers -> module
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (samples, seed) -> (inputs, labels)
    kind: str  # "tokens" (a language model), "image" or "classes"
    # whether the exporter's optimiser may run: it folds a training BatchNorm into its Conv as if it were
    # inference's, leaving a file of another model (ResNet exports with ``optimize=False``)
    optimize: bool = True


def _eager(config: object) -> object:
    config._attn_implementation = "eager"  # type: ignore[attr-defined]
    return config


def _tokens(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)
    return ids, torch.randint(0, VOCAB, (samples, SEQ), generator=generator)


def _sentences(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)
    return ids, torch.randint(0, 4, (samples,), generator=generator)


def _images(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn((samples, 3, 32, 32), generator=generator)
    return pixels, torch.randint(0, 10, (samples,), generator=generator)


def _seeded(build: Callable[[int], torch.nn.Module]) -> Callable[[int], torch.nn.Module]:
    """The family's module from seed 0, its vectors (norm scales, biases) moved off their initial values.

    A fresh model's norm scales are all ones and its biases all zeros: the exporter's optimiser merges
    operators that then compute the same value (GPT-NeoX's two norms of one input) and drops a bias of
    zeros, so its file would say less than the module trains."""

    def seeded(layers: int) -> torch.nn.Module:
        torch.manual_seed(0)
        module = build(layers)
        with torch.no_grad():
            for parameter in module.parameters():
                if parameter.dim() == 1:
                    parameter.add_(0.02 * torch.randn_like(parameter))
        return module

    return seeded


def _llama(layers: int) -> torch.nn.Module:
    import transformers as hf

    config = hf.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return WithLoss(hf.LlamaForCausalLM(_eager(config)), "input_ids", use_cache=False)


def _qwen3(layers: int) -> torch.nn.Module:
    import transformers as hf

    config = hf.Qwen3Config(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return WithLoss(hf.Qwen3ForCausalLM(_eager(config)), "input_ids", use_cache=False)


def _gemma3(layers: int) -> torch.nn.Module:
    """Gemma 3: norms that cast back with ``type_as``, sliding-window and full attention in turn, and its output
    matrix the token embedding (tied, as Hugging Face builds it: the exporter stores it twice, once transposed)."""
    import transformers as hf

    config = hf.Gemma3TextConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        sliding_window=8,
        layer_types=[("sliding_attention", "full_attention")[layer % 2] for layer in range(layers)],
    )
    return WithLoss(hf.Gemma3ForCausalLM(_eager(config)), "input_ids", use_cache=False)


def _phi3(layers: int) -> torch.nn.Module:
    """Phi-3: Q, K and V as slices of one fused projection; the rotary part is the whole head, so the part it
    leaves is an empty slice the exporter drops."""
    import transformers as hf

    config = hf.Phi3Config(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        pad_token_id=0,
    )
    return WithLoss(hf.Phi3ForCausalLM(_eager(config)), "input_ids", use_cache=False)


def _falcon(layers: int) -> torch.nn.Module:
    """Falcon: multi-query attention whose one key and value are looked up by a list of positions
    (``x[..., [-2], :]``); the exporter ends each lookup's operators with a Transpose it merges into the
    reader's ``transpose(1, 2)``, so the lookup's value is in the file only in another order (its output matrix
    apart from the embedding, as Gemma 3's)."""
    import transformers as hf

    config = hf.FalconConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        multi_query=True,
        parallel_attn=True,
        new_decoder_architecture=False,
        alibi=False,
        bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return WithLoss(hf.FalconForCausalLM(_eager(config)), "input_ids", use_cache=False)


def _gpt2(layers: int) -> torch.nn.Module:
    """GPT-2: Conv1D projections (``addmm`` of a flattened view, which the exporter merges with the reshape
    before it) and learned positions looked up at positions the exporter folds in (its output matrix apart from
    the embedding: tied, no stage could start between them, and its test trains a pipelined plan)."""
    import transformers as hf

    config = hf.GPT2Config(
        n_layer=layers,
        n_embd=64,
        n_head=4,
        n_positions=SEQ,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    return WithLoss(hf.GPT2LMHeadModel(_eager(config)), "input_ids", use_cache=False)


def _roberta(layers: int) -> torch.nn.Module:
    """RoBERTa: positions counted from the tokens (a cumulative sum cast with ``type_as``, plus a cache length of
    0 the exporter folds away)."""
    import transformers as hf

    config = hf.RobertaConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ + 2,
        num_labels=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return WithLoss(hf.RobertaForSequenceClassification(_eager(config)), "input_ids")


def _gpt_neox(layers: int) -> torch.nn.Module:
    import transformers as hf

    config = hf.GPTNeoXConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=256,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return WithLoss(hf.GPTNeoXForCausalLM(_eager(config)), "input_ids", use_cache=False)


def _bert(layers: int, dropout: float = 0.0) -> torch.nn.Module:
    import transformers as hf

    config = hf.BertConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_labels=4,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return WithLoss(hf.BertForSequenceClassification(_eager(config)), "input_ids")


def _vit(layers: int) -> torch.nn.Module:
    import transformers as hf

    config = hf.ViTConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return WithLoss(hf.ViTForImageClassification(_eager(config)), "pixel_values")


def _resnet(layers: int) -> torch.nn.Module:
    import transformers as hf

    config = hf.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[layers, layers],
        layer_type="basic",
        num_labels=10,
    )
    return WithLoss(hf.ResNetForImageClassification(config), "pixel_values")


def _bloom(layers: int) -> torch.nn.Module:
    """BLOOM: ALiBi biases, and heads folded into the batch for each bmm and back, which the exporter writes as one
    4-D MatMul (`autopar.torch.mapping`'s merged nodes)."""
    import transformers as hf

    config = hf.BloomConfig(
        n_layer=layers,
        hidden_size=64,
        n_head=4,
        vocab_size=VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    return WithLoss(hf.BloomForCausalLM(_eager(config)), "input_ids", use_cache=False)


def _moe(layers: int) -> torch.nn.Module:
    """OLMoE: 8 experts, top 2, run as transformers' ``batched_mm`` (each routed token's expert weights gathered
    from the stacks; the default ``grouped_mm`` calls an operator the ONNX exporter cannot translate)."""
    import transformers as hf

    config = hf.OlmoeConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    config._experts_implementation = "batched_mm"
    return WithLoss(hf.OlmoeForCausalLM(_eager(config)), "input_ids", use_cache=False)


def _deepseek_v3(layers: int) -> torch.nn.Module:
    """DeepSeek-V3: latent attention (queries and keys and values through low-rank projections, key states
    written into ``new_empty`` by two slice assignments), a dense first layer, then 4 routed experts, top 2 of one
    group, and a shared one (``batched_mm``); routing weights over their sum plus 1e-20, which the exporter folds."""
    import transformers as hf

    config = hf.DeepseekV3Config(
        num_hidden_layers=layers,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    config._experts_implementation = "batched_mm"
    return WithLoss(hf.DeepseekV3ForCausalLM(_eager(config)), "input_ids", use_cache=False)


def _mamba2(layers: int) -> torch.nn.Module:
    """Mamba2: a state-space scan in chunks of 8 (transformers' torch path: the chunked scan's einsums, cumulative
    sums and segment masks), 8 heads of 16, one group."""
    import transformers as hf

    config = hf.Mamba2Config(
        num_hidden_layers=layers,
        hidden_size=64,
        state_size=16,
        expand=2,
        n_groups=1,
        head_dim=16,
        num_heads=8,
        chunk_size=8,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    return WithLoss(hf.Mamba2ForCausalLM(config), "input_ids", use_cache=False)


FAMILIES = {
    family.name: family
    for family in (
        Family("llama", _seeded(_llama), _tokens, "tokens"),
        Family("qwen3", _seeded(_qwen3), _tokens, "tokens"),
        Family("gpt_neox", _seeded(_gpt_neox), _tokens, "tokens"),
        Family("bert", _seeded(_bert), _sentences, "classes"),
        Family("vit", _seeded(_vit), _images, "image"),
        Family("resnet", _seeded(_resnet), _images, "image", optimize=False),
        Family("moe", _seeded(_moe), _tokens, "tokens"),
        Family("gemma3", _seeded(_gemma3), _tokens, "tokens"),
        Family("phi3", _seeded(_phi3), _tokens, "tokens"),
        Family("roberta", _seeded(_roberta), _sentences, "classes"),
        Family("falcon", _seeded(_falcon), _tokens, "tokens"),
        Family("gpt2", _seeded(_gpt2), _tokens, "tokens"),
        Family("bloom", _seeded(_bloom), _tokens, "tokens"),
        Family("deepseek_v3", _seeded(_deepseek_v3), _tokens, "tokens"),
        Family("mamba2", _seeded(_mamba2), _tokens, "tokens"),
    )
}


WITH_DROPOUT = {
    "bert_dropout": Family("bert_dropout", _seeded(functools.partial(_bert, dropout=0.1)), _sentences, "classes")
}
"""Families at Hugging Face's default dropout (BERT's 0.1 on its embeddings, attention probabilities, residuals and
classifier): a sharded run equals one process only where that process draws the ranks' masks
(`autopar.torch.dropout.MasksAsPlanned`)."""


def family_named(name: str) -> Family:
    """A family by name, among `FAMILIES` and `WITH_DROPOUT`."""
    return FAMILIES[name] if name in FAMILIES else WITH_DROPOUT[name]


def export(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], path: str, optimize: bool = True) -> None:
    """Write the module's dynamo export, node metadata and all, as a user does before planning."""
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # "no torchvision"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "exporting a model in training mode": it is trained
        program = torch.onnx.export(module, inputs, dynamo=True, verbose=False, optimize=optimize)
    assert program is not None  # the dynamo exporter always returns its program
    program.save(path)
