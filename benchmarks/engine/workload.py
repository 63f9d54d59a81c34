"""The multi-turn chat workload: C conversations of T turns behind one shared system prompt.

Turn t of a conversation sends system + u1 + a1 + ... + u_t and gets a_t back; conversations take
turns round-robin (turn 1 of every conversation, then turn 2, ...), so by the time a conversation
comes back, C - 1 others have run through the GPU pool. Tokens are seeded random ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChatShape:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "user_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"expected {name} > 0, got {getattr(self, name)}")
        for name in ("system_tokens", "answer_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"expected {name} >= 0, got {getattr(self, name)}")

    def prompt_tokens(self, turn: int) -> int:
        """Prompt length at ``turn`` (1-based)."""
        return self.system_tokens + turn * self.user_tokens + (turn - 1) * self.answer_tokens

    @property
    def history_tokens(self) -> int:
        """One conversation's tokens after its last answer."""
        return self.prompt_tokens(self.turns) + self.answer_tokens


@dataclass(frozen=True)
class Turn:
    conversation: int
    index: int  # 1-based
    prompt: np.ndarray  # int64 token ids
    answer: np.ndarray


def chat_turns(shape: ChatShape, vocab: int, seed: int = 0) -> list[Turn]:
    """Every turn of the workload, in the order the clients send them."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, shape.system_tokens)
    history = [system.copy() for _ in range(shape.conversations)]
    out = []
    for t in range(1, shape.turns + 1):
        for c in range(shape.conversations):
            prompt = np.concatenate([history[c], rng.integers(0, vocab, shape.user_tokens)])
            answer = rng.integers(0, vocab, shape.answer_tokens)
            out.append(Turn(c, t, prompt, answer))
            history[c] = np.concatenate([prompt, answer])
    return out


def unique_turns(
    count: int, prompt_tokens: int, answer_tokens: int, vocab: int, seed: int
) -> list[Turn]:
    """``count`` requests of random tokens: no two share a block (the chance that a block of 16
    random ids repeats is about vocab ** -16)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        prompt = rng.integers(0, vocab, prompt_tokens)
        out.append(Turn(i, 1, prompt, rng.integers(0, vocab, answer_tokens)))
    return out
