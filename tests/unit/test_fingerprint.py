"""`system_fingerprint` on CPU names the processor: MKL (reproducible only per processor),
oneDNN and torch pick their kernels by its instruction sets, so a seeded answer can differ
between two hosts that run the same build on the same weights (seen: the default model's
first sampled answer, same commit and same fingerprint, differed between two of this
project's development machines). That part of it, worker/threads.py: cpu_signature."""

from __future__ import annotations

import torch

import llmserve.engine.build as build
import llmserve.worker.threads as threads
from llmserve.config import Config, DeviceConfig, ModelConfig

CPUINFO = {"vendor_id": "GenuineIntel", "cpu family": "6", "model": "143", "model name": "Xeon",
           "flags": "fpu hypervisor avx2 sse4_2 amx_tile constant_tsc avx512f fma bmi2 rdrand"}


def test_the_cpu_signature_names_the_processor_and_its_kernel_instruction_sets(monkeypatch):
    monkeypatch.setattr(threads, "_cpuinfo", lambda: CPUINFO)
    monkeypatch.setattr(threads, "_mkl_cbwr_get", lambda: lambda which: 0x10002)
    monkeypatch.setattr(threads, "_mkl_auto_branch", lambda: lambda: 14)
    for name in threads._KERNEL_ENV:
        monkeypatch.delenv(name, raising=False)
    sig = threads.cpu_signature()
    capability = torch.backends.cpu.get_cpu_capability()
    assert sig == f"GenuineIntel 6 143 {capability} cbwr=0x10002 branch=14 amx_tile avx2 avx512f bmi2 fma sse4_2"
    monkeypatch.setattr(threads, "_cpuinfo", lambda: {**CPUINFO, "model": "207"})
    assert threads.cpu_signature() != sig
    # what caps the libraries' choice of kernels counts too (MKL's reported branch; oneDNN
    # has no getter, so its environment variable)
    monkeypatch.setattr(threads, "_cpuinfo", lambda: CPUINFO)
    monkeypatch.setattr(threads, "_mkl_auto_branch", lambda: lambda: 10)
    assert threads.cpu_signature() == sig.replace("branch=14", "branch=10")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in threads.cpu_signature()


def test_an_arm_signature_names_the_part_and_its_features(monkeypatch):
    monkeypatch.setattr(threads, "_cpuinfo", lambda: {"CPU implementer": "0x41", "CPU part": "0xd40",
                                                      "Features": "fp asimd sve bf16 i8mm"})
    monkeypatch.setattr(threads, "_mkl_cbwr_get", lambda: None)
    monkeypatch.setattr(threads.platform, "machine", lambda: "aarch64")
    for name in threads._KERNEL_ENV:
        monkeypatch.delenv(name, raising=False)
    capability = torch.backends.cpu.get_cpu_capability()
    assert threads.cpu_signature() == f"aarch64 0x41 0xd40 {capability} asimd bf16 fp i8mm sve"


def test_the_engine_fingerprint_changes_with_the_processor(tiny_model, monkeypatch):
    prints: list[str] = []
    real = build.system_fingerprint
    monkeypatch.setattr(build, "system_fingerprint", lambda *a: prints.append(real(*a)) or prints[-1])
    cfg = Config(model=ModelConfig(model=str(tiny_model)), device=DeviceConfig(threads=1))
    build.build_engine(cfg)
    build.build_engine(cfg)
    monkeypatch.setattr(build, "cpu_signature", lambda: "GenuineIntel 6 207 AVX2 avx avx2 fma")
    build.build_engine(cfg)
    assert prints[0] == prints[1] != prints[2]
