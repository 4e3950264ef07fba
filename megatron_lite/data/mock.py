"""`--mock-data`: synthetic token sequences, a pure function of (seed, sample index), for tests and
throughput runs without a corpus. Like a real dataset, each sample holds seq_length + 1 tokens: inputs
are the first seq_length, labels the last seq_length."""

from __future__ import annotations

import torch


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int = 1234, num_samples: int = 1 << 40) -> None:
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        # A little structure (a repeating motif plus noise) so a model can learn something.
        period = int(torch.randint(2, 9, (1,), generator=gen))
        motif = torch.randint(0, self.vocab_size, (period,), generator=gen)
        seq = motif.repeat(self.seq_length // period + 2)[: self.seq_length + 1]
        noise = torch.rand(self.seq_length + 1, generator=gen) < 0.1
        seq = torch.where(noise, torch.randint(0, self.vocab_size, seq.shape, generator=gen), seq)
        return {
            "tokens": seq[:-1].clone(),
            "labels": seq[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length),
        }


def collate(samples: list[dict[str, torch.Tensor]], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]).to(device) for k in samples[0]}
