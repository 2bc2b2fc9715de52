"""graph.py + blocks.py: repeated blocks, segments, batch rescaling, fingerprints, saved activations.

The saved-activation check follows Korthikanti et al. (arXiv 2205.05198): one GPT layer in 16-bit
keeps s b h (34 + 5 a s / h) bytes for its backward pass.
"""

import functools

import pytest
import torch
from torch import nn

from autopar.capture.export import capture
from autopar.models import build_model

BUILTIN_BLOCK_MODELS = ["gpt", "llama", "bert", "vit", "moe", "mlp"]



@functools.lru_cache(maxsize=None)
def captured(spec: str, batch_size: int = 2, dtype: torch.dtype | None = None, with_loss: bool = True):
    bundle = build_model(spec, batch_size=batch_size)
    model = bundle.model.to(dtype) if dtype is not None else bundle.model
    loss = dict(loss_fn=bundle.loss_fn, example_targets=bundle.example_targets) if with_loss else {}
    return bundle, capture(model, bundle.example_inputs, name=spec, **loss)


def check_blocks_and_segments(graph, container: str, num_layers: int) -> None:
    assert len(graph.blocks) == 1, [(group.container, group.instances) for group in graph.blocks]
    group = graph.blocks[0]
    assert group.container == container
    assert group.instances == tuple(f"{container}.{index}" for index in range(num_layers))
    # Position i is the same op in every instance.
    targets = [[graph[name].target for name in names] for names in group.nodes]
    assert all(instance == targets[0] for instance in targets)
    assert group.template == group.nodes[0] and len(group.template) > 0
    # Segments: prologue, each block in order, epilogue; together every call exactly once.
    names = [segment.name for segment in graph.segments]
    assert names == ["prologue", *group.instances, "epilogue"]
    assert [segment.block_group for segment in graph.segments] == [None, *[0] * num_layers, None]
    assert [segment.nodes for segment in graph.segments[1:-1]] == list(group.nodes)
    in_order = [name for segment in graph.segments for name in segment.nodes]
    assert in_order == [node.name for node in graph.calls()]


@pytest.mark.parametrize("family", BUILTIN_BLOCK_MODELS)
def test_builtin_blocks_form_one_group(family):
    _, graph = captured(f"{family}:layers=3")
    check_blocks_and_segments(graph, "layers", 3)


def hf_graph(name: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0))
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, vocab_size=128,
            max_position_embeddings=32))
    kwargs = {"input_ids": torch.randint(0, 128, (2, 16))}
    if name != "bert":
        kwargs["use_cache"] = False
    return capture(model, (), kwargs)


@pytest.mark.parametrize("name,container", [
    ("gpt2", "transformer.h"), ("llama", "model.layers"), ("bert", "bert.encoder.layer")])
def test_hugging_face_blocks_form_one_group(name, container):
    check_blocks_and_segments(hf_graph(name), container, 3)


class TwoStacks(nn.Module):
    """A narrow stack, a projection, a wide stack whose first block differs from the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.project = nn.Linear(8, 16)
        self.decoder = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32))

    def forward(self, x):
        for layer in self.encoder:
            x = torch.relu(layer(x))
        return self.decoder(self.project(x))


def test_blocks_group_by_structure_and_segments_mark_the_gaps():
    graph = capture(TwoStacks(), (torch.randn(4, 8),))
    assert [(group.container, group.instances) for group in graph.blocks] == [
        ("encoder", ("encoder.0", "encoder.1")), ("decoder", ("decoder.0",)), ("decoder", ("decoder.1", "decoder.2"))]
    # The root's own ops between blocks (the relus, the projection) are segments of their own.
    segments = [(segment.name.split(":")[0], segment.block_group, [graph[name].target.removeprefix("aten.")
                                                                   for name in segment.nodes])
                for segment in graph.segments]
    assert segments == [
        ("encoder.0", 0, ["linear.default"]), ("between", None, ["relu.default"]),
        ("encoder.1", 0, ["linear.default"]), ("between", None, ["relu.default", "linear.default"]),
        ("decoder.0", 1, ["linear.default"]), ("decoder.1", 2, ["linear.default"]),
        ("decoder.2", 2, ["linear.default"])]


# --- with_batch and fingerprint -----------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt", "llama", "vit", "moe"])
def test_with_batch_matches_a_capture_at_that_batch(family):
    # Three layers: the batch-2 capture is the one test_builtin_blocks_form_one_group made.
    _, at_two = captured(f"{family}:layers=3")
    _, at_four = captured(f"{family}:layers=3", batch_size=4)
    rescaled = at_two.with_batch(4)
    assert rescaled.batch_size == 4 and [node.name for node in rescaled.nodes] == [node.name for node in at_four.nodes]
    for scaled, direct in zip(rescaled.nodes, at_four.nodes):
        assert [meta.shape for meta in scaled.outputs] == [meta.shape for meta in direct.outputs], scaled.name
        assert scaled.fwd_flops == pytest.approx(direct.fwd_flops, rel=1e-9), scaled.name
        assert scaled.bwd_flops == pytest.approx(direct.bwd_flops, rel=1e-9), scaled.name
        # Bytes are rescaled by the op's own inputs + outputs: close, not exact (e.g. layer norm's
        # float32 statistics, the copies inside einsum).
        scaled_bytes = sum(kernel.io_bytes for kernel in scaled.fwd_kernels)
        direct_bytes = sum(kernel.io_bytes for kernel in direct.fwd_kernels)
        assert scaled_bytes == pytest.approx(direct_bytes, rel=0.1), scaled.name
    assert rescaled.fwd_flops == pytest.approx(2 * at_two.fwd_flops, rel=1e-12)
    assert rescaled.saved_activation_bytes() == pytest.approx(at_four.saved_activation_bytes(), rel=1e-3)


def test_with_batch_scales_batch_dims_only():
    bundle, graph = captured("gpt", with_loss=False)
    config = bundle.config
    at_five = graph.with_batch(5)
    logits = at_five[[node for node in graph.nodes if node.kind == "output"][0].inputs[0]].output
    assert logits.shape == (5, config.seq, config.vocab) and logits.batch_dims == (0,)
    scores = next(node for node in at_five.calls() if node.target == "aten.softmax.int").output
    assert scores.shape == (5, config.heads, config.seq, config.seq)
    mask = next(node for node in at_five.calls() if node.target == "aten.ones.default").output
    assert mask.shape == (config.seq, config.seq) and mask.batch_dims == ()  # fixed dims stay
    for param in at_five.params:
        assert at_five[param.node].output == graph[param.node].output
    for batch in (1, 3, 8):
        assert graph.with_batch(batch).fwd_flops == pytest.approx(graph.fwd_flops * batch / 2, rel=1e-12)
        assert graph.with_batch(batch).bwd_flops == pytest.approx(graph.bwd_flops * batch / 2, rel=1e-12)
    assert graph.with_batch(2) is graph
    round_trip = graph.with_batch(8).with_batch(2)
    assert [node.outputs for node in round_trip.nodes] == [node.outputs for node in graph.nodes]
    assert round_trip.fwd_flops == pytest.approx(graph.fwd_flops, rel=1e-12)


def test_fingerprint_identifies_the_model_not_the_batch():
    _, at_two = captured("gpt:layers=3")  # the captures of the tests above
    _, at_four = captured("gpt:layers=3", batch_size=4)
    _, wider = captured("gpt:layers=3,hidden=128")
    _, shallower = captured("gpt")  # two layers
    assert at_two.fingerprint() == at_four.fingerprint() == at_two.with_batch(7).fingerprint()
    assert wider.fingerprint() != at_two.fingerprint()
    assert shallower.fingerprint() != at_two.fingerprint()


# --- saved activations ----------------------------------------------------------------------------

# Realistic per-layer shape (GPT-3 6.7B): the causal mask (one s x s bool per layer) is 0.4% of the total.
SEQ, HIDDEN, HEADS = 2048, 4096, 32


def korthikanti_bytes(*, seq: int, batch: int, hidden: int, heads: int) -> float:
    return seq * batch * hidden * (34 + 5 * heads * seq / hidden)


def layer_saved_bytes(attention: str) -> float:
    spec = f"gpt:layers=2,hidden={HIDDEN},heads={HEADS},seq={SEQ},vocab=51200,dropout=0.1,attention={attention}"
    _, graph = captured(spec, dtype=torch.bfloat16, with_loss=False)
    graph = graph.with_batch(1)
    (group,) = graph.blocks
    per_instance = {graph.saved_activation_bytes(names) for names in group.nodes}
    assert len(per_instance) == 1  # identical layers keep identical activations
    return per_instance.pop()


def test_saved_activations_of_a_gpt_layer_match_korthikanti():
    expected = korthikanti_bytes(seq=SEQ, batch=1, hidden=HIDDEN, heads=HEADS)
    assert layer_saved_bytes("eager") == pytest.approx(expected, rel=0.05)


def test_flash_attention_keeps_no_seq_by_seq_matrix():
    """SDPA runs as flash attention: q, k, v, the output and the log-sum-exp are kept instead of
    the softmax, its dropout mask and output (5 a s^2 b bytes), leaving Korthikanti's 34 s b h."""
    eager, flash = layer_saved_bytes("eager"), layer_saved_bytes("sdpa")
    assert flash < 0.4 * eager
    assert flash == pytest.approx(34 * SEQ * 1 * HIDDEN, rel=0.05)


def test_saved_activations_count_each_storage_once():
    _, graph = captured("gpt", with_loss=False)
    template = [graph[name] for name in graph.blocks[0].template]
    q_k_v = [node for node in template if node.target == "aten.linear.default"][:3]
    normed = graph[q_k_v[0].inputs[0]]
    assert normed.target == "aten.layer_norm.default" and all(node.inputs[0] == normed.name for node in q_k_v)
    # Three projections save the same LayerNorm output: it is kept once.
    assert graph.saved_activation_bytes([node.name for node in q_k_v]) == normed.output.nbytes
    whole = graph.saved_activation_bytes()
    assert whole <= sum(graph.saved_activation_bytes([node.name]) for node in graph.calls())
    assert graph.saved_activation_bytes([]) == 0


def test_summary_names_blocks_and_counts():
    _, graph = captured("gpt:layers=3")
    from autopar.report.graph_summary import graph_summary

    text = graph_summary(graph)
    assert "captured with export, batch 2 (dynamic)" in text
    assert f"parameters: {graph.num_params:,}" in text
    assert "layers[0..] x3 identical" in text
