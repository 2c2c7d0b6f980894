"""Roofline-style cost curves: seconds as a non-negative combination of a few features (a fixed cost
per call, rows, bytes read, attended pairs), fitted by non-negative least squares to measurements of
one layer on the device, saved as JSON so a cluster can be planned from another machine."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# what each curve is a function of; every feature is additive across calls except "calls"
DECODE_ATTENTION = ("calls", "seqs", "kv_tokens")
PREFILL_ATTENTION = ("calls", "seqs", "tokens", "pairs")
HEAD = ("calls", "rows")
HOST = ("calls", "seqs", "micro_batches", "prompts")  # per step; prompts: admissions


@dataclass(frozen=True)
class LinearCost:
    """seconds = sum(coefficient * feature), every coefficient >= 0 (a cost never pays back)."""

    features: tuple[str, ...]
    coefficients: tuple[float, ...]

    def seconds(self, **values: float) -> float:
        unknown = set(values) - set(self.features)
        if unknown:
            raise KeyError(f"cost curve over {self.features} got unknown features {sorted(unknown)}")
        return sum(c * values.get(f, 0.0) for f, c in zip(self.features, self.coefficients))

    @classmethod
    def fit(cls, features: tuple[str, ...], rows: list[dict[str, float]], seconds: list[float],
            scale: list[float] | None = None) -> LinearCost:
        """Non-negative least squares of relative errors (each row's error divided by its `scale`, by default
        its own seconds), so a curve spanning microseconds to seconds is right at both ends."""
        if len(rows) < len(features):
            raise ValueError(f"fitting {features} needs at least {len(features)} measurements, got {len(rows)}")
        x = torch.tensor([[row.get(f, 0.0) for f in features] for row in rows], dtype=torch.float64)
        y = torch.tensor(seconds, dtype=torch.float64)
        weight = 1.0 / torch.tensor(scale if scale is not None else seconds, dtype=torch.float64).clamp_min(1e-9)
        return cls(tuple(features), tuple(nnls(x * weight[:, None], y * weight)))


@dataclass(frozen=True)
class TabulatedCost:
    """seconds of one call at `x`, interpolated linearly between measured points (extrapolated along the
    last segment). For costs no few-term formula follows: a grouped expert GEMM's efficiency changes with
    the rows each expert gets, so its time is measured at every power of two of the token count."""

    points: tuple[tuple[float, float], ...]  # (x, seconds), x increasing

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        if len(xs) < 2 or any(b <= a for a, b in zip(xs, xs[1:])):
            raise ValueError(f"a tabulated cost needs two or more points with increasing x, got {xs}")

    def seconds(self, x):
        """At a number or at every element of a tensor."""
        xs = torch.tensor([p[0] for p in self.points], dtype=torch.float64)
        ys = torch.tensor([p[1] for p in self.points], dtype=torch.float64)
        at = torch.as_tensor(x, dtype=torch.float64)
        i = torch.searchsorted(xs, at).clamp(1, len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        out = (y0 + (at - x0) * (y1 - y0) / (x1 - x0)).clamp_min(0.0)
        return float(out) if out.dim() == 0 else out


def nnls(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """min ||x b - y|| subject to b >= 0: least squares over an active set, dropping the most negative
    coefficient until none is negative (few features: at most one pass per feature)."""
    scale = x.abs().amax(dim=0).clamp_min(1e-30)  # columns of seconds-per-token and per-call differ by 1e6
    xs = x / scale
    active = list(range(x.shape[1]))
    coef = torch.zeros(x.shape[1], dtype=x.dtype)
    while active:
        solution = torch.linalg.lstsq(xs[:, active], y[:, None], driver="gelsd").solution[:, 0]
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(solution.argmin()))
    return (coef / scale).tolist()


@dataclass(frozen=True)
class CostCurves:
    """One layer of one model on one device, plus what scales it to the whole model."""

    key: str  # device, model shape, dtype and library versions: what the measurements depend on
    device_type: str  # "cuda" or "cpu": where it was measured
    device_free_bytes: int  # free device memory beside the loaded model when measured
    host_free_bytes: int  # free host memory then
    num_layers: int
    num_experts: int  # 0 for a dense feed-forward
    top_k: int
    kv_bytes_per_token: int  # all layers
    decode_attention: LinearCost
    prefill_attention: LinearCost
    feed_forward: TabulatedCost  # one feed-forward (MoE) call, by its token count
    head: LinearCost
    host: LinearCost  # per engine step, beyond its attention, feed-forward and head calls
    copy_bytes_per_s: float  # host pages <-> device pages

    def ffn_seconds(self, tokens):
        """One feed-forward call of `tokens` rows (a number or a tensor of them)."""
        return self.feed_forward.seconds(tokens)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostCurves:
        raw = json.loads(text)
        curves = {name: LinearCost(tuple(raw[name]["features"]), tuple(raw[name]["coefficients"]))
                  for name in ("decode_attention", "prefill_attention", "head", "host")}
        ffn = TabulatedCost(tuple(tuple(p) for p in raw["feed_forward"]["points"]))
        return cls(**{**raw, **curves, "feed_forward": ffn})

    @classmethod
    def load(cls, path: str | Path) -> CostCurves:
        try:
            return cls.from_json(Path(path).read_text())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a cost-curve file written by `batchgen plan --save-curves`: "
                             f"{exc}") from exc
