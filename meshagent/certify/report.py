"""A certification's capability record and its report (JSON and Markdown)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import llama_cpp

from meshagent.certify.checks import Certification, CutResult
from meshagent.certify.soak import SoakResult
from meshagent.models.capability import CapabilityRecord, WireResult
from meshagent.wording import layer_range


def wire_results(results: list[CutResult], dtypes: tuple[str, ...]) -> tuple[WireResult, ...]:
    """Per dtype, over every cut: a dtype is exact only if every cut was."""
    out = []
    for dtype in dtypes:
        rs = [r for r in results if r.dtype == dtype]
        if not rs:
            continue
        positions = sum(r.positions for r in rs)
        out.append(
            WireResult(
                dtype=dtype,
                top1_agreement=round(sum(r.agree for r in rs) / max(positions, 1), 6),
                max_logit_diff=round(max(r.max_logit_diff for r in rs), 6),
                greedy_identical=all(r.greedy_identical for r in rs),
                chunked_prefill_identical=all(r.chunked_identical for r in rs),
                positions=positions,
            )
        )
    return tuple(out)


def build_record(
    cert: Certification,
    *,
    model_sha256: str,
    certifier: str,
    layer_types: tuple[str, ...],
    state_kind: str,
    state_portable: bool,
) -> CapabilityRecord:
    layout = cert.layout
    return CapabilityRecord(
        model_sha256=model_sha256,
        model_name=Path(layout.path).name.removesuffix(".gguf"),
        architecture=layout.architecture,
        n_layers=layout.n_layers,
        splittable=True,
        layer_types=layer_types,
        state_kind=state_kind,
        state_portable=state_portable,
        cuts=tuple(dict.fromkeys(r.cut for r in cert.results)),
        wire=wire_results(cert.results, cert.settings.dtypes),
        certified_ctx=cert.certified_ctx,
        llama_cpp_version=f"llama-cpp-python {llama_cpp.__version__}",
        certifier=certifier,
        certified_at=round(time.time(), 3),
        prompts=tuple(r.prompt.name for r in cert.references),
    )


def report_json(
    cert: Certification, record: CapabilityRecord, soaked: SoakResult | None = None
) -> dict[str, Any]:
    return {
        "record": record.to_dict(),
        "soak": None if soaked is None else soaked.to_dict(),
        "settings": {
            "tokens": cert.settings.tokens,
            "ctx": cert.settings.ctx,
            "threads": cert.settings.threads,
        },
        "prompts": [
            {
                "name": r.prompt.name,
                "prompt_tokens": len(r.tokens),
                "generated": list(r.generated),
            }
            for r in cert.references
        ],
        "results": [
            {
                "cut": list(r.cut),
                "dtype": r.dtype,
                "positions": r.positions,
                "top1_agreement": r.agree / max(r.positions, 1),
                "max_logit_diff": r.max_logit_diff,
                "greedy_identical": r.greedy_identical,
                "first_divergence": r.first_divergence,
                "chunked_prefill_identical": r.chunked_identical,
                "chunked_prefill_max_logit_diff": r.chunked_max_diff,
            }
            for r in cert.results
        ],
        "seconds": round(cert.seconds, 1),
    }


def report_markdown(
    cert: Certification, record: CapabilityRecord, soaked: SoakResult | None = None
) -> str:
    exact = ", ".join(record.exact_dtypes()) or "none"
    lines = [
        f"# Certification of {record.model_name}",
        "",
        f"- model sha256: `{record.model_sha256}`",
        f"- architecture: {record.architecture}, {record.n_layers} layers, "
        f"state: {record.state_kind}",
        f"- certified exact on the wire: **{exact}** "
        "(a split with these gives the whole model's greedy output on every prompt and cut)",
        f"- context certified: {record.certified_ctx} tokens; "
        f"{cert.settings.tokens} greedy tokens per prompt",
        f"- engine: {record.llama_cpp_version}; certified by `{record.certifier}`",
        f"- took {cert.seconds:.0f} s",
        "",
        "| cut | wire | top-1 agreement | max logit diff | greedy identical | "
        "first divergence (prompt: position) | chunked prefill |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in cert.results:
        div = ", ".join(f"{k}: {v}" for k, v in r.first_divergence.items()) or "-"
        chunk = "identical" if r.chunked_identical else "differs"
        lines.append(
            f"| {'/'.join(map(str, r.cut))} | {r.dtype} | {r.agree}/{r.positions} | "
            f"{r.max_logit_diff:.4g} | {'yes' if r.greedy_identical else 'no'} | {div} | "
            f"{chunk} (max diff {r.chunked_max_diff:.3g}) |"
        )
    if soaked is None:
        lines += ["", "Soak: not run."]
    else:
        verdict = "passed" if soaked.passed else f"FAILED ({soaked.error or 'texts differ'})"
        stages = ", ".join(layer_range(a, b) for a, b in soaked.stages) or "-"
        lines += [
            "",
            f"Soak ({soaked.wire_dtype} wire, 3 agent processes, stages {stages}, against one "
            f"whole agent): {soaked.identical}/{soaked.requests} answers identical, "
            f"{soaked.seconds:.0f} s: {verdict}.",
        ]
    lines += [
        "",
        "Prompts: "
        + ", ".join(f"{r.prompt.name} ({len(r.tokens)} tokens)" for r in cert.references),
        "",
    ]
    return "\n".join(lines)
