"""`autopar::grouped_mm`: forward and backward against per-expert matmuls, empty experts, rows past
the last offset, export on meta, and torch's custom-op checks."""

import torch

from autopar.models.grouped_mm import grouped_mm


def reference(tokens, weight, offs):
    pieces, start = [], 0
    for expert, end in enumerate(offs.tolist()):
        pieces.append(tokens[start:end] @ weight[expert])
        start = end
    rest = tokens[start:].new_zeros(tokens.shape[0] - start, weight.shape[2])
    return torch.cat([*pieces, rest])


def operands(offs, rows=10):
    torch.manual_seed(0)
    tokens = torch.randn(rows, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(len(offs), 6, 5, dtype=torch.float64, requires_grad=True)
    return tokens, weight, torch.tensor(offs, dtype=torch.int32)


def test_forward_and_backward_match_per_expert_matmuls():
    for offs in ([3, 3, 7, 10], [0, 0, 10, 10], [2, 4, 6, 8]):  # an empty expert, all in one, rows past the end
        tokens, weight, offsets = operands(offs)
        output = grouped_mm(tokens, weight, offsets)
        expected = reference(tokens, weight, offsets)
        torch.testing.assert_close(output, expected)
        grad = torch.randn_like(output)
        got = torch.autograd.grad(output, (tokens, weight), grad)
        want = torch.autograd.grad(expected, (tokens, weight), grad)
        for actual, wanted in zip(got, want):
            torch.testing.assert_close(actual, wanted)


def test_passes_torch_custom_op_checks():
    tokens, weight, offsets = operands([3, 3, 7, 10])
    torch.library.opcheck(torch.ops.autopar.grouped_mm.default, (tokens, weight, offsets))


def test_exports_on_meta_as_one_op():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4, 6, 5, device="meta"))

        def forward(self, tokens, offs):
            return grouped_mm(tokens, self.weight, offs)

    inputs = (torch.empty(10, 6, device="meta"), torch.empty(4, dtype=torch.int32, device="meta"))
    program = torch.export.export(Experts(), inputs, strict=False)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert targets == ["autopar.grouped_mm.default"]
