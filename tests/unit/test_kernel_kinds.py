"""benchmarks/kernel_kinds.py: the predicted step by op beside a profiler's device time by op."""

from benchmarks.kernel_kinds import measured_ms, op_table, row_of

MODEL = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,seq=32,vocab=128"


def test_capture_and_profiler_names_meet_in_one_row():
    assert row_of("aten.mm.default") == row_of("aten::mm") == "mm"
    assert row_of("aten._scaled_dot_product_flash_attention_backward.default") == \
        row_of("aten::_cudnn_attention_backward") == "attention backward"
    assert row_of("aten.masked_fill.Scalar") == row_of("aten::masked_fill_") == "masked_fill"
    assert row_of("aten._to_copy.default") == row_of("aten::copy_") == row_of("aten.clone.default") == "copy / cast"
    assert row_of("aten::_foreach_addcdiv_") == "optimizer"


def test_the_table_sets_measured_beside_predicted(tmp_path):
    kernels = tmp_path / "kernels.txt"
    kernels.write_text("    1.000 ms  some_kernel\n\n# device time by aten op (self)\n"
                       "     2.000 ms  aten::mm\n     0.500 ms  aten::_cudnn_attention_forward\n"
                       "     4.000 ms  aten::_foreach_mul_\n")
    assert measured_ms(str(kernels)) == {"mm": 2.0, "attention forward": 0.5, "optimizer": 4.0}
    table = op_table(MODEL, 2, "cpu:procs=1", str(kernels)).splitlines()
    mm = next(line for line in table if line.startswith("| mm |"))
    assert float(mm.split("|")[3]) == 2.0 and float(mm.split("|")[2]) > 0
    assert table[-1].startswith("| **all but the optimizer** |") and "| 2.5 |" in table[-1]
