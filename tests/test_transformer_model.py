"""Tests for models/transformer.py: validity, shapes, numerics against numpy, presets, CLI."""

from __future__ import annotations

import math
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from models.transformer import (
    PRESETS,
    build_preset,
    build_transformer,
    expected_parameter_count,
    main,
    parameter_count,
    parameter_shapes,
)

TINY = dict(layers=2, hidden=32, heads=4, seq=8, vocab=64, batch=2)
KINDS = ("gpt", "bert")
LAYERNORMS = ("fused", "decomposed")


def tiny(kind: str, **overrides) -> onnx.ModelProto:
    return build_transformer(kind=kind, **{**TINY, **overrides})


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def random_batch(seed: int = 1):
    rng = np.random.default_rng(seed)
    shape = (TINY["batch"], TINY["seq"])
    return rng.integers(0, TINY["vocab"], shape), rng.integers(0, TINY["vocab"], shape)


def run(model: onnx.ModelProto, ids: np.ndarray, labels: np.ndarray | None = None) -> dict:
    feeds = {"input_ids": ids.astype(np.int64)}
    if labels is not None:
        feeds["labels"] = labels.astype(np.int64)
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session(model).run(names, feeds)))


# --- a numpy reference of the intended computation -----------------------------------------


def _reference(model: onnx.ModelProto, ids: np.ndarray, labels: np.ndarray):
    """Forward pass and mean cross-entropy in numpy, from the model's random initializers."""
    w = {init.name: numpy_helper.to_array(init).astype(np.float64) for init in model.graph.initializer}
    kind = "gpt" if any(n.op_type == "Tanh" for n in model.graph.node) else "bert"
    heads, (b, s) = TINY["heads"], ids.shape
    erf = np.vectorize(math.erf)

    def ln(x, name):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * w[f"{name}.weight"] + w[f"{name}.bias"]

    def linear(x, name):
        return x @ w[f"{name}.weight"] + w[f"{name}.bias"]

    def gelu(x):
        if kind == "bert":
            return 0.5 * x * (1 + erf(x / math.sqrt(2)))
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    def attention(x, p):
        def split(t):
            return t.reshape(b, s, heads, -1).transpose(0, 2, 1, 3)

        q, k, v = (split(linear(x, f"{p}.{n}")) for n in "qkv")
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
        if kind == "gpt":
            scores = scores + np.triu(np.full((s, s), -10000.0), k=1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, -1)
        return linear(context, f"{p}.out")

    def mlp(x, p):
        return linear(gelu(linear(x, f"{p}.fc1")), f"{p}.fc2")

    x = w["embed.tok.weight"][ids] + w["embed.pos.weight"]
    if kind == "bert":
        x = ln(x, "embed.ln")
    for i in range(TINY["layers"]):
        p = f"layer{i}"
        if kind == "bert":
            x = ln(x + attention(x, f"{p}.attn"), f"{p}.ln1")
            x = ln(x + mlp(x, f"{p}.mlp"), f"{p}.ln2")
        else:
            x = x + attention(ln(x, f"{p}.ln1"), f"{p}.attn")
            x = x + mlp(ln(x, f"{p}.ln2"), f"{p}.mlp")
    if kind == "gpt":
        x = ln(x, "ln_f")
    logits = x @ w["logits.weight"]
    flat = logits.reshape(-1, logits.shape[-1])
    log_probs = flat - flat.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    loss = -log_probs[np.arange(flat.shape[0]), labels.reshape(-1)].mean()
    return logits, loss


# --- structural validity -------------------------------------------------------------------


@pytest.mark.parametrize("weights", ("elided", "random"))
@pytest.mark.parametrize("layernorm", LAYERNORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_checker_accepts_model(kind, layernorm, weights):
    model = tiny(kind, layernorm=layernorm, weights=weights)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]


@pytest.mark.parametrize("weights", ("elided", "random"))
@pytest.mark.parametrize("layernorm", LAYERNORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_node_output_has_a_static_shape(kind, layernorm, weights):
    model = tiny(kind, layernorm=layernorm, weights=weights)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    infos = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for node in model.graph.node:
        for out in node.output:
            assert out in infos, f"no inferred type for {out}"
            tensor_type = infos[out].type.tensor_type
            assert tensor_type.HasField("shape"), f"{out} has no shape"
            assert all(d.HasField("dim_value") and d.dim_value > 0 for d in tensor_type.shape.dim), out
    b, s, v, h = TINY["batch"], TINY["seq"], TINY["vocab"], TINY["hidden"]

    def dims(name):
        return [d.dim_value for d in infos[name].type.tensor_type.shape.dim]

    assert dims("logits") == [b, s, v] and dims("loss") == []
    assert dims("layer0.attn.k.transpose") == [b, TINY["heads"], h // TINY["heads"], s]
    assert dims("layer1.attn.scores") == [b, TINY["heads"], s, s]
    assert dims("layer1.mlp.gelu") == [b, s, 4 * h]


@pytest.mark.parametrize("kind", KINDS)
def test_node_names_are_unique_and_name_their_output(kind):
    model = tiny(kind, layernorm="decomposed")
    names = [n.name for n in model.graph.node]
    assert len(names) == len(set(names)) and all(names)
    for node in model.graph.node:
        assert list(node.output) == [node.name] or (
            node.op_type == "ConstantOfShape" and node.name == f"{node.output[0]}__init"
        )
    expected = {
        "embed.tok",
        "embed.pos",
        "layer0.attn.q",
        "layer0.attn.k",
        "layer0.attn.v",
        "layer0.attn.out",
        "layer1.mlp.fc1",
        "layer1.mlp.fc2",
        "layer1.mlp.gelu",
        "layer1.ln1",
        "layer1.ln2",
        "logits",
        "loss",
    }
    expected |= {"ln_f", "mask", "layer0.attn.mask"} if kind == "gpt" else {"embed.ln"}
    assert expected <= set(names)


def test_graph_interface_and_loss_flag():
    model = tiny("gpt")
    b, s = TINY["batch"], TINY["seq"]
    inputs = {
        i.name: (i.type.tensor_type.elem_type, [d.dim_value for d in i.type.tensor_type.shape.dim])
        for i in model.graph.input
    }
    assert inputs == {"input_ids": (TensorProto.INT64, [b, s]), "labels": (TensorProto.INT64, [b, s])}
    assert [o.name for o in model.graph.output] == ["loss", "logits"]
    no_loss = tiny("bert", loss=False)
    assert [i.name for i in no_loss.graph.input] == ["input_ids"]
    assert [o.name for o in no_loss.graph.output] == ["logits"]
    assert not any(n.op_type == "SoftmaxCrossEntropyLoss" for n in no_loss.graph.node)


def test_operator_choices_per_kind_and_layernorm_mode():
    def ops(m):
        return {n.op_type for n in m.graph.node}

    gpt, bert = ops(tiny("gpt")), ops(tiny("bert"))
    assert "Tanh" in gpt and "Erf" not in gpt and "Where" in gpt
    assert "Erf" in bert and "Tanh" not in bert and "Where" not in bert
    assert "LayerNormalization" in gpt
    decomposed = ops(tiny("gpt", layernorm="decomposed"))
    assert "LayerNormalization" not in decomposed and {"ReduceMean", "Sqrt"} <= decomposed


def test_only_parameters_are_non_scalar_float_tensors():
    """The mask is built in-graph and constants are scalars, so nothing else looks like a weight."""
    for weights in ("elided", "random"):
        model = tiny("gpt", weights=weights)
        params = parameter_shapes(model)
        for init in model.graph.initializer:
            if init.data_type == TensorProto.FLOAT and init.name not in params:
                assert list(init.dims) == [], init.name
        assert all(name.endswith((".weight", ".bias")) for name in params)


def test_elided_parameters_use_constant_of_shape_with_fill_values():
    model = tiny("gpt")
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    fills = {}
    for node in model.graph.node:
        if node.op_type == "ConstantOfShape":
            assert node.input[0] == f"{node.output[0]}__shape" and node.input[0] in inits
            fills[node.output[0]] = numpy_helper.to_array(node.attribute[0].t).item()
    assert fills["layer0.ln1.weight"] == 1.0 and fills["ln_f.weight"] == 1.0
    assert fills["layer0.ln1.bias"] == 0.0 and fills["layer0.attn.q.weight"] == 0.0
    assert set(fills) == set(parameter_shapes(model))
    assert parameter_shapes(model)["layer0.mlp.fc1.weight"] == (32, 128)


# --- numerics with onnxruntime -------------------------------------------------------------


def with_large_parameters(model: onnx.ModelProto, std: float = 0.3) -> onnx.ModelProto:
    """Copy of a random-weight model with every parameter redrawn from normal(0, std).

    The GPT-2 init (std 0.02, zero biases, unit LayerNorm scales) keeps activations so
    small that GELU, the mask and the biases barely matter; these weights exercise them.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    params = parameter_shapes(model)
    rng = np.random.default_rng(11)
    for init in model.graph.initializer:
        if init.name in params:
            value = rng.normal(0.0, std, size=tuple(init.dims)).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(value, name=init.name))
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_onnxruntime_matches_numpy_reference(kind):
    model = with_large_parameters(tiny(kind, weights="random"))
    ids, labels = random_batch()
    out = run(model, ids, labels)
    logits, loss = _reference(model, ids, labels)
    assert logits.std() > 0.5  # the activations are not vanishingly small
    np.testing.assert_allclose(out["logits"], logits, atol=1e-4, rtol=1e-4)
    assert abs(float(out["loss"]) - loss) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_loss_at_gpt2_init_is_near_log_vocab(kind):
    ids, labels = random_batch()
    out = run(tiny(kind, weights="random", seed=3), ids, labels)
    assert out["loss"].shape == () and np.isfinite(out["loss"])
    assert abs(float(out["loss"]) - math.log(TINY["vocab"])) < 0.1  # near-uniform logits


@pytest.mark.parametrize("kind", KINDS)
def test_fused_and_decomposed_layernorm_agree(kind):
    ids, labels = random_batch()
    fused = run(tiny(kind, weights="random", seed=5, layernorm="fused"), ids, labels)
    decomposed = run(tiny(kind, weights="random", seed=5, layernorm="decomposed"), ids, labels)
    np.testing.assert_allclose(fused["logits"], decomposed["logits"], atol=1e-4)
    assert abs(float(fused["loss"]) - float(decomposed["loss"])) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_elided_model_runs(kind):
    ids, labels = random_batch()
    out = run(tiny(kind), ids, labels)  # all-zero weights: uniform logits
    assert np.allclose(out["logits"], 0.0)
    assert abs(float(out["loss"]) - math.log(TINY["vocab"])) < 1e-5


def test_gpt_is_causal_and_bert_is_not():
    ids, _ = random_batch()
    changed = ids.copy()
    t = 5
    changed[:, t] = (changed[:, t] + 1) % TINY["vocab"]
    for kind in KINDS:
        model = tiny(kind, weights="random", seed=7, loss=False)
        before, after = run(model, ids)["logits"], run(model, changed)["logits"]
        prefix_delta = np.abs(before[:, :t] - after[:, :t]).max()
        assert np.abs(before[:, t:] - after[:, t:]).max() > 1e-4
        if kind == "gpt":
            assert prefix_delta < 1e-6
        else:
            assert prefix_delta > 1e-4


# --- presets, parameter counts, argument checks, CLI ---------------------------------------


def test_gpt3_preset_builds_fast_and_small_with_175b_parameters():
    start = time.perf_counter()
    model = build_preset("gpt3")
    assert time.perf_counter() - start < 10.0
    assert model.ByteSize() < 1_000_000
    count = parameter_count(model)
    assert count == expected_parameter_count("gpt", 96, 12288, 2048, 50304)
    layers, hidden, vocab = 96, 12288, 50304
    rough = 12 * layers * hidden**2 + 2 * vocab * hidden  # layers + embedding + untied head
    assert abs(count - rough) / rough < 0.02
    assert abs(count - 175e9) / 175e9 < 0.01


@pytest.mark.parametrize("name", sorted(set(PRESETS) - {"gpt3"}))
def test_presets_match_the_analytic_parameter_count(name):
    model = build_preset(name, batch=4)
    cfg = PRESETS[name]
    assert parameter_count(model) == expected_parameter_count(
        cfg["kind"], cfg["layers"], cfg["hidden"], cfg["seq"], cfg["vocab"]
    )
    assert model.ByteSize() < 200_000


def test_known_preset_sizes():
    # GPT-2 small is 124.4M with a tied head; the untied head adds vocab * hidden.
    gpt2 = expected_parameter_count("gpt", 12, 768, 1024, 50304)
    assert gpt2 - 50304 * 768 == pytest.approx(124.4e6, rel=0.01)
    assert PRESETS["bert-base"]["vocab"] == 30592 and PRESETS["bert-base"]["seq"] == 512
    assert PRESETS["gpt2"]["seq"] == 1024 and PRESETS["gpt3"]["seq"] == 2048


def test_random_and_elided_count_the_same_parameters():
    assert (
        parameter_count(tiny("bert", weights="random"))
        == parameter_count(tiny("bert"))
        == expected_parameter_count("bert", **{k: TINY[k] for k in ("layers", "hidden", "seq", "vocab")})
    )
    assert parameter_count(tiny("gpt", ffn=48)) == expected_parameter_count("gpt", 2, 32, 8, 64, ffn=48)


def test_build_preset_overrides_and_rejects_unknown_names():
    model = build_preset("gpt2", layers=1, seq=16, batch=1)
    assert "layer0.attn.q" in {n.name for n in model.graph.node}
    assert "layer1.attn.q" not in {n.name for n in model.graph.node}
    with pytest.raises(ValueError, match="unknown preset"):
        build_preset("gpt5")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden=30, heads=4), "divisible"),
        (dict(layers=0), "layers"),
        (dict(seq=-1), "seq"),
        (dict(vocab=2.5), "vocab"),
        (dict(batch=True), "batch"),
        (dict(ffn=0), "ffn"),
        (dict(kind="t5"), "kind"),
        (dict(weights="zeros"), "weights"),
        (dict(layernorm="rms"), "layernorm"),
        (dict(seed=-1), "seed"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout="0.1"), "dropout"),
        (dict(layers=24, hidden=2048, heads=16, weights="random"), "protobuf limit"),
    ],
)
def test_bad_arguments_raise_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_transformer(**{**TINY, **overrides})


def test_cli_writes_model(tmp_path, capsys):
    out = tmp_path / "bert.onnx"
    main(
        [
            "--preset",
            "bert-base",
            "--layers",
            "1",
            "--seq",
            "16",
            "--batch",
            "2",
            "--layernorm",
            "decomposed",
            "--no-loss",
            "--out",
            str(out),
        ]
    )
    model = onnx.load(str(out))
    assert [o.name for o in model.graph.output] == ["logits"]
    assert any(n.op_type == "Erf" for n in model.graph.node)
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--hidden", "30", "--heads", "4", "--out", str(tmp_path / "bad.onnx")])
    assert not (tmp_path / "bad.onnx").exists()
