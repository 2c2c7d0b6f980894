"""What the planner plans for: each prompt's length and how many tokens it generates."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadShape:
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]  # tokens each sample generates (max_tokens; a stop or EOS only shortens the job)
    samples: tuple[int, ...] = ()  # each prompt's n (sequences forked from its prefill); () for one each

    def __post_init__(self) -> None:
        if not self.prompt_lens or len(self.prompt_lens) != len(self.output_lens):
            raise ValueError(f"a workload needs one output length per prompt, got {len(self.prompt_lens)} prompts "
                             f"and {len(self.output_lens)} output lengths")
        if min(self.prompt_lens) < 1 or min(self.output_lens) < 1:
            raise ValueError("prompt and output lengths must be at least 1")
        if self.samples and (len(self.samples) != len(self.prompt_lens) or min(self.samples) < 1):
            raise ValueError(f"a workload's samples need one count >= 1 per prompt, got {self.samples!r}")

    @property
    def sample_counts(self) -> tuple[int, ...]:
        """Each prompt's n."""
        return self.samples or (1,) * len(self.prompt_lens)

    @property
    def sequences(self) -> int:
        """Sequences the engine runs: every prompt's samples."""
        return sum(self.sample_counts)

    @property
    def max_context(self) -> int:
        return max(p + o for p, o in zip(self.prompt_lens, self.output_lens))

    @property
    def mean_context(self) -> float:
        return statistics.mean(p + o for p, o in zip(self.prompt_lens, self.output_lens))

    def describe(self) -> dict:
        described = {"prompts": len(self.prompt_lens), "mean_prompt": round(statistics.mean(self.prompt_lens), 1),
                     "mean_output": round(statistics.mean(self.output_lens), 1), "max_output": max(self.output_lens)}
        if self.sequences > len(self.prompt_lens):
            described["sequences"] = self.sequences
        return described

    @classmethod
    def synthetic(cls, num_prompts: int, prompt_len: tuple[int, int], mu: float, sigma: float, max_output: int,
                  seed: int = 0) -> WorkloadShape:
        """Prompt lengths uniform in [low, high), output lengths lognormal(mu, sigma) + 1 capped at
        `max_output`: the shape of bench/bct.py's workload."""
        rng = random.Random(seed)
        prompts = [rng.randrange(*prompt_len) for _ in range(num_prompts)]
        outputs = [min(max_output, int(rng.lognormvariate(mu, sigma)) + 1) for _ in range(num_prompts)]
        return cls(tuple(prompts), tuple(outputs))

    @classmethod
    def default(cls, max_model_len: int) -> WorkloadShape:
        """What an engine plans for when nobody described the job: a batch job's stream of chat-sized prompts
        (512 of 32-512 tokens) with a tail of outputs (median 55, capped at 256), cut to the model's context."""
        shape = cls.synthetic(512, (32, 512), mu=4.0, sigma=0.8, max_output=256)
        return shape.fit(max_model_len)

    def fit(self, max_model_len: int) -> WorkloadShape:
        """The same workload with each prompt and output cut to fit a context of `max_model_len` tokens."""
        prompts = tuple(min(p, max(1, max_model_len // 2)) for p in self.prompt_lens)
        outputs = tuple(max(1, min(o, max_model_len - p)) for p, o in zip(prompts, self.output_lens))
        return WorkloadShape(prompts, outputs, self.samples)

    def sample(self, count: int, seed: int = 0) -> WorkloadShape:
        """At most `count` prompts drawn at random (all of them if fewer), for planning a very large job."""
        if len(self.prompt_lens) <= count:
            return self
        picks = random.Random(seed).sample(range(len(self.prompt_lens)), count)
        return WorkloadShape(tuple(self.prompt_lens[i] for i in picks), tuple(self.output_lens[i] for i in picks),
                             tuple(self.samples[i] for i in picks) if self.samples else ())
