"""benchmarks/one_device_step.py (the GPU check's step) runs end to end on the CPU and reports
predicted beside measured."""

from benchmarks.one_device_step import measure, report

MODEL = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64"


def test_one_device_step_reports_predicted_and_measured(one_process_group):
    result = measure(MODEL, "cpu:procs=1", global_batch=4, precision="fp32", warmup=1, steps=2)
    assert len(result["times_s"]) == 2 and result["measured_s"] > 0
    table = report(result, MODEL, 4)
    assert "| step time (ms) |" in table and "| MFU |" in table and "predicted memory (GiB)" in table
