"""A loader check's verdict (shared.messages.LoadReport) as one line: what is wrong, and the known cause with its fix.

Pure text: the child's `python -m child.loadcheck` prints it, the supervisor puts it in its errors (a refused
export, a failed finalize, `verify`). The known causes are measured on transformers 5.17 and written up with
minimal reproductions in docs/fidelity.md. Owns wording only; never imports torch.
"""
from __future__ import annotations

from shared.messages import LoadReport

SHOWN = 4  # names quoted in a one-line message


def problems(report: LoadReport) -> str | None:
    """None when the report is clean (or the check could not run), else one line: what is wrong and why."""
    if not report.checked:
        return None
    parts = []
    for what, names in (("missing", report.missing), ("unexpected", report.unexpected),
                        ("with a wrong shape", report.mismatched)):
        if names:
            more = f", … {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            parts.append(f"{len(names)} weights {what} ({', '.join(names[:SHOWN])}{more})")
    if report.error:
        parts.append(f"the loader failed: {report.error}")
    if not parts:
        return None
    reason = explain(report)
    return "; ".join(parts) + (f". {reason}" if reason else "")


def transformers_only(report: LoadReport) -> bool:
    """Whether every problem in the report is a known limitation of transformers' MoE expert loading (its expert
    converter), not of the checkpoint: what `[export] consumer = "vllm"` lets through (vLLM reads the per-expert
    compressed-tensors weights itself). Unexplained missing/unexpected weights are never lifted."""
    if not report.checked or problems(report) is None:
        return False
    experts = [k for k in (*report.missing, *report.unexpected, *report.mismatched) if ".experts." in k]
    all_experts = len(experts) == len(report.missing) + len(report.unexpected) + len(report.mismatched)
    if report.error and not ("experts" in report.error and "conversion" in report.error):
        return False
    return all_experts and bool(explain(report))


def LIFT_HINT(report: LoadReport) -> str:  # noqa: N802 (reads as a constant in the messages)
    """The refusal's tail naming the key that lifts it, where it applies (transformers_only)."""
    return ('; to export it for vLLM anyway (vLLM loads these experts), set [export] consumer = "vllm"'
            if transformers_only(report) else "")


def explain(report: LoadReport) -> str:
    """The known cause behind a report, with the fix; "" when none applies. Details: docs/fidelity.md."""
    expert_scales = [k for k in report.unexpected if ".experts." in k and k.endswith(".weight_global_scale")]
    expert_zeros = [k for k in report.unexpected if ".experts." in k and k.endswith(".weight_zero_point")]
    expert_conversion = "experts" in report.error and "conversion" in report.error
    fused_missing = [k for k in report.missing if ".experts." in k and k.rsplit(".", 1)[-1] in (
        "gate_up_proj", "down_proj", "up_proj", "gate_up_proj_bias", "down_proj_bias")]
    if expert_scales:
        return ("transformers 5.17 drops MoE experts' weight_global_scale when it decompresses NVFP4 experts (its "
                "compressed-tensors expert converter collects weight_packed/weight_scale/weight_shape only), so the "
                "experts would load wrong; use W4A16 or FP8_DYNAMIC, or leave the experts dense "
                "(ignore 're:.*experts.*'); see docs/fidelity.md")
    if expert_zeros:
        return ("transformers 5.17 decompresses MoE experts without their weight_zero_point (asymmetric schemes), so "
                "the experts would load wrong; use a symmetric scheme (W4A16) or leave the experts dense "
                "(ignore 're:.*experts.*'); see docs/fidelity.md")
    if expert_conversion:
        return ("transformers 5.17's compressed-tensors expert converter cannot decompress this scheme's experts; use "
                "W4A16 or FP8_DYNAMIC, or leave the experts dense (ignore 're:.*experts.*'); see docs/fidelity.md")
    if fused_missing:
        return ("transformers 5.17 holds these experts as fused 3D parameters and maps no quantized per-expert "
                "tensors onto them, so they would load as random weights; leave the experts dense (add "
                "'re:.*experts.*' to [export] ignore) to export the rest; see docs/fidelity.md")
    return ""
