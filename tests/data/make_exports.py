"""Write the small Hugging Face exports the tests plan and verify: models the project did not write.

Usage: python tests/data/make_exports.py [--out tests/data] [--only albert,t5,swin]

Needs torch, onnxscript and transformers (not autopar's dependencies; the tests use the files
kept here and never run this). Each model is built from a random-initialised configuration of its
family with a seed, given its training loss, and exported by torch 2.13:

- ``hf_albert_dynamo.onnx``: ALBERT masked LM, 6 layers sharing one set of weights (dynamo): each
  shared weight is transposed once and that Transpose is read by every layer.
- ``hf_t5_legacy.onnx``: T5 encoder-decoder with its loss (legacy; dynamo fails on it): an Expand
  whose shape is computed with Where/Equal, which ONNX's inference leaves unknown.
- ``hf_swin_legacy.onnx``: Swin image classifier with windows of 4 (legacy): window pad sizes
  computed at run time (Shape -> Mod -> Pad).
- ``hf_olmoe_dynamo.onnx``: OLMoE causal LM, one layer of 8 experts, top-2 (dynamo), its experts
  run as transformers' ``batched_mm``: each routed token's expert weights taken from the
  ``[experts, ...]`` stacks by GatherND. (The default ``grouped_mm`` calls a custom operator without
  an ONNX translation; the eager experts loop over the experts hit, which torch.export refuses.)
- ``hf_mixtral_dynamo.onnx``: Mixtral causal LM, 2 layers of 8 experts, top-2 (dynamo, ``batched_mm``), written
  unoptimised as ``bench/large_exports.py`` writes the full-size ones: the stacks and the gathered weights
  pass identity Transposes, the routed indices are built by Concat, and SwiGLU's halves come from
  ``torch.split`` (`autopar route` rewrites this form, ``tests/test_graph_experts.py``).
- ``hf_deepseek_v3_dynamo.onnx``: DeepSeek-V3 causal LM, one dense layer then one of 8 routed experts
  (top-2 of 2 groups, one group kept) and a shared one, latent attention (dynamo, ``batched_mm``): its
  router's ``e_score_correction_bias`` is a buffer read only by the top-k choice, so no gradient reaches it.
- ``hf_clip_dynamo.onnx``: CLIP, a text and a vision tower of 2 layers each and the contrastive loss
  (dynamo): the text tower pools each sequence at its end token, found by ArgMax.
- ``hf_mamba2_dynamo.onnx``: Mamba2 causal LM, 2 layers of 4 heads, chunks of 4 positions (dynamo): the
  chunked scan in PyTorch (no CUDA kernels here), its projections split by ``torch.split``.

Parameters (float initializers that are not buffers) go to an external file that is not kept:
autopar reads their shapes only, and verification draws random values. Node doc strings and the
dynamo exporter's stack traces are dropped; its layer names are kept.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# tests/ holds modules named like packages this script imports (torch_gpt, ...): keep them out of the way
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

BATCH = 4
SEQ = 16


def _with_loss(model, keyword: str = "input_ids", **options):
    """The model with its training loss as the one output: ``model(keyword=ids, labels=labels, **options).loss``.

    The argument is named ``ids`` whatever it holds: the dynamo exporter records the signature, and the
    files kept here were written with that name."""
    import torch

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.model(**{keyword: ids}, labels=labels, **options).loss

    return WithLoss()


def _albert():
    import torch
    import transformers as hf

    config = hf.AlbertConfig(
        vocab_size=256,
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    config._attn_implementation = "eager"
    model = hf.AlbertForMaskedLM(config)

    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return _with_loss(model), (ids, ids), ["ids", "labels"]


def _t5():
    import torch
    import transformers as hf

    config = hf.T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = hf.T5ForConditionalGeneration(config)

    ids = torch.randint(1, config.vocab_size, (BATCH, SEQ))
    return _with_loss(model, use_cache=False), (ids, ids), ["ids", "labels"]


def _swin():
    import torch
    import transformers as hf

    config = hf.SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10
    )
    model = hf.SwinForImageClassification(config)

    return (
        _with_loss(model, "pixel_values"),
        (torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))),
        ["pixels", "labels"],
    )


def _olmoe():
    import torch
    import transformers as hf

    config = hf.OlmoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts=8,
        num_experts_per_tok=2,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = "batched_mm"
    model = hf.OlmoeForCausalLM(config)

    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return _with_loss(model, use_cache=False), (ids, ids), ["ids", "labels"]


def _mixtral():
    import torch
    import transformers as hf

    config = hf.MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = "batched_mm"
    model = hf.MixtralForCausalLM(config)

    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return _with_loss(model, use_cache=False), (ids, ids), ["ids", "labels"]


def _deepseek_v3():
    import torch
    import transformers as hf

    config = hf.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        max_position_embeddings=64,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = "batched_mm"
    model = hf.DeepseekV3ForCausalLM(config)

    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return _with_loss(model, use_cache=False), (ids, ids), ["ids", "labels"]


def _mamba2():
    import torch
    import transformers as hf

    config = hf.Mamba2Config(
        vocab_size=128,
        hidden_size=32,
        state_size=8,
        num_heads=4,
        head_dim=16,
        n_groups=1,
        expand=2,
        chunk_size=4,
        num_hidden_layers=2,
    )
    model = hf.Mamba2ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return _with_loss(model, use_cache=False), (ids, ids), ["ids", "labels"]


def _clip():
    import torch
    import transformers as hf

    text = hf.CLIPTextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
    )
    vision = hf.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    config = hf.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16)
    config._attn_implementation = "eager"
    model = hf.CLIPModel(config)

    class Contrastive(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, pixel_values=pixels, return_loss=True).loss

    ids = torch.randint(1, text.vocab_size, (BATCH, SEQ))
    return Contrastive(), (ids, torch.randn(BATCH, 3, 32, 32)), ["ids", "pixels"]


KEPT_METADATA = {"pkg.torch.onnx.name_scopes"}  # the layer names a plan shows; stack traces are dropped
UNOPTIMISED = {"mixtral"}  # exported as bench/large_exports.py exports the full-size models
FAMILIES = {
    "albert": (_albert, True),
    "t5": (_t5, False),
    "swin": (_swin, False),
    "olmoe": (_olmoe, True),
    "mixtral": (_mixtral, True),
    "deepseek_v3": (_deepseek_v3, True),
    "clip": (_clip, True),
    "mamba2": (_mamba2, True),
}


def export(kind: str, out: Path) -> Path:
    import math

    import onnx
    import torch
    from onnx.external_data_helper import set_external_data

    build, dynamo = FAMILIES[kind]
    torch.manual_seed(0)
    module, args, names = build()
    module.eval()
    path = out / f"hf_{kind}_{'dynamo' if dynamo else 'legacy'}.onnx"
    if dynamo:
        torch.onnx.export(module, args, str(path), dynamo=True, input_names=names, optimize=kind not in UNOPTIMISED)
    else:
        torch.onnx.export(module, args, str(path), dynamo=False, input_names=names, opset_version=17)
    proto = onnx.load(str(path))
    for node in proto.graph.node:
        node.doc_string = ""
        kept = [(p.key, p.value) for p in node.metadata_props if p.key in KEPT_METADATA]
        del node.metadata_props[:]
        for key, value in kept:
            node.metadata_props.add(key=key, value=value)
    buffers = {name for name, _ in module.named_buffers()}
    for tensor in proto.graph.initializer:
        if tensor.name not in buffers and tensor.data_type == onnx.TensorProto.FLOAT and math.prod(tensor.dims) > 1:
            set_external_data(tensor, path.name + ".weights")
    onnx.save(proto, str(path))
    for stray in (path.parent / (path.name + ".weights"), path.parent / (path.name + ".data")):
        stray.unlink(missing_ok=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--only", default=",".join(FAMILIES))
    args = parser.parse_args()
    for kind in args.only.split(","):
        path = export(kind, args.out)
        print(f"{path}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
