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
    sig = threads.cpu_signature()
    capability = torch.backends.cpu.get_cpu_capability()
    assert sig == f"GenuineIntel 6 143 {capability} amx_tile avx2 avx512f bmi2 fma sse4_2"
    monkeypatch.setattr(threads, "_cpuinfo", lambda: {**CPUINFO, "model": "207"})
    assert threads.cpu_signature() != sig


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
