"""Split of the L residual branches into N contiguous summary blocks (Block AttnRes / MSAR).

Blocks are numbered 1..N (block 0 is the embedding source b_0). Sizes follow ``array_split``:
exactly N blocks whose sizes differ by at most one, longer blocks first (docs/decisions.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class BlockLayout:
    n_branches: int  # L
    n_blocks: int  # N (N == L: the Full variant)

    def __post_init__(self) -> None:
        if not 1 <= self.n_blocks <= self.n_branches:
            raise ValueError(
                f"residual.n_blocks={self.n_blocks} must be in [1, {self.n_branches}] "
                f"(the model has {self.n_branches} residual branches = 2 * n_layers)"
            )

    @cached_property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """Per block n (index n-1): inclusive 1-based branch range (first, last)."""
        base, extra = divmod(self.n_branches, self.n_blocks)
        out, start = [], 1
        for n in range(self.n_blocks):
            size = base + (1 if n < extra else 0)
            out.append((start, start + size - 1))
            start += size
        return tuple(out)

    def block_of(self, branch: int) -> int:
        for n, (lo, hi) in enumerate(self.bounds, start=1):
            if lo <= branch <= hi:
                return n
        raise IndexError(f"branch {branch} outside 1..{self.n_branches}")

    def is_first(self, branch: int) -> bool:
        return self.bounds[self.block_of(branch) - 1][0] == branch

    def is_last(self, branch: int) -> bool:
        return self.bounds[self.block_of(branch) - 1][1] == branch

    def state_after(self, branches_done: int) -> tuple[int, bool]:
        """(number of completed sources incl. b_0, whether a partial is carried) after the first
        ``branches_done`` branches."""
        if branches_done == 0:
            return 1, False
        n = self.block_of(branches_done)
        if self.is_last(branches_done):
            return n + 1, False
        return n, True
