"""Workloads: who sends which prompt, in which order. Tokens are seeded random ids.

- ``chat``: C conversations of T turns behind one shared system prompt. Turn t sends
  system + u1 + a1 + ... + u_t and gets a_t back; conversations take turns round-robin (turn 1 of
  every conversation, then turn 2, ...), so by the time a conversation comes back, C - 1 others have
  run through the GPU pool.
- ``fits``: the same shape with many short conversations behind a long system prompt, and a GPU
  pool that holds all of it: the case where offloading has nothing to win and must cost nothing.
- ``docs``: N documents of K tokens (after an optional shared system prompt); each request picks a
  document at random and adds its own question.
- ``mixed``: the chat workload with unique prompts (sharing nothing, not even the system prompt)
  interleaved: every ``1 / unique_share``-th request on average is one.

A request is *returning* when the KV of its prefix was computed by an earlier request (a chat turn
>= 2, a document seen before); the speedups and targets are over returning requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("chat", "fits", "docs", "mixed")


@dataclass(frozen=True)
class Turn:
    conversation: int  # conversation or document id; -1 for a unique prompt
    index: int  # 1-based: the turn of its conversation, or the how-many-th use of its document
    prompt: np.ndarray  # int64 token ids
    answer: np.ndarray

    @property
    def returning(self) -> bool:
        return self.index >= 2


@dataclass(frozen=True)
class ChatShape:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int

    def __post_init__(self) -> None:
        _positive(self, "conversations", "turns", "user_tokens")
        _non_negative(self, "system_tokens", "answer_tokens")

    def prompt_tokens(self, turn: int) -> int:
        """Prompt length at ``turn`` (1-based)."""
        return self.system_tokens + turn * self.user_tokens + (turn - 1) * self.answer_tokens

    @property
    def history_tokens(self) -> int:
        """One conversation's tokens after its last answer."""
        return self.prompt_tokens(self.turns) + self.answer_tokens


@dataclass(frozen=True)
class DocShape:
    documents: int
    document_tokens: int
    requests: int
    system_tokens: int  # shared by every request, before the document
    question_tokens: int
    answer_tokens: int

    def __post_init__(self) -> None:
        _positive(self, "documents", "document_tokens", "requests", "question_tokens")
        _non_negative(self, "system_tokens", "answer_tokens")

    @property
    def request_tokens(self) -> int:
        return self.system_tokens + self.document_tokens + self.question_tokens


@dataclass(frozen=True)
class Workload:
    """One workload (``kind`` in ``KINDS``); ``chat`` for chat/fits/mixed, ``docs`` for docs."""

    kind: str
    chat: ChatShape | None = None
    docs: DocShape | None = None
    unique_share: float = 0.0  # mixed: the share of requests that are unique prompts

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"expected a workload in {KINDS}, got {self.kind!r}")
        if (self.kind == "docs") != (self.docs is not None) or (self.chat is None) == (
            self.docs is None
        ):
            raise ValueError(
                f"expected a DocShape for workload 'docs' and a ChatShape otherwise, got "
                f"{self.kind!r} with chat={self.chat is not None}, docs={self.docs is not None}"
            )
        if self.kind == "mixed" and not 0.0 < self.unique_share < 1.0:
            raise ValueError(f"expected 0 < unique_share < 1 for 'mixed', got {self.unique_share}")
        if self.kind != "mixed" and self.unique_share:
            raise ValueError(f"expected unique_share only for 'mixed', got it for {self.kind!r}")

    def turns(self, vocab: int, seed: int = 0) -> list[Turn]:
        """Every request of the workload, in the order the clients send them."""
        if self.docs is not None:
            return doc_turns(self.docs, vocab, seed)
        assert self.chat is not None
        turns = chat_turns(self.chat, vocab, seed)
        if self.kind != "mixed":
            return turns
        return mix_in_unique(turns, self.unique_share, self.mean_prompt_tokens(), vocab, seed)

    def requests(self) -> int:
        """How many requests ``turns`` returns."""
        if self.docs is not None:
            return self.docs.requests
        assert self.chat is not None
        return self.chat.conversations * self.chat.turns + self.unique_requests()

    def verify_shape(self) -> ChatShape:
        """A conversation shaped like this workload's requests, for the correctness check."""
        if self.chat is not None:
            return self.chat
        assert self.docs is not None
        d = self.docs
        return ChatShape(
            1, 2, d.system_tokens + d.document_tokens, d.question_tokens, d.answer_tokens
        )

    def mean_prompt_tokens(self) -> int:
        if self.docs is not None:
            return self.docs.request_tokens
        assert self.chat is not None
        c = self.chat
        return round(sum(c.prompt_tokens(t) for t in range(1, c.turns + 1)) / c.turns)

    @property
    def answer_tokens(self) -> int:
        shape = self.docs if self.docs is not None else self.chat
        assert shape is not None
        return shape.answer_tokens

    def distinct_blocks(self, block_size: int) -> int:
        """Full blocks of distinct KV the whole workload computes, i.e. the blocks a prefix cache
        that never evicts ends up holding: shared prefixes (the system prompt, a document) count
        once; docs counts every document, used or not."""
        bs = block_size
        if self.docs is not None:
            d = self.docs
            shared = d.system_tokens // bs
            per_doc = (d.system_tokens + d.document_tokens) // bs - shared
            own = (d.request_tokens + d.answer_tokens) // bs - shared - per_doc
            return shared + d.documents * per_doc + d.requests * own
        assert self.chat is not None
        c = self.chat
        shared = c.system_tokens // bs
        total = shared + c.conversations * (c.history_tokens // bs - shared)
        if self.kind == "mixed":
            total += self.unique_requests() * ((self.mean_prompt_tokens() + c.answer_tokens) // bs)
        return total

    def history_blocks(self, block_size: int) -> int:
        """Blocks of every conversation's final history counted apart (a shared system prompt
        once per conversation), plus the unique prompts' (mixed); docs: ``distinct_blocks``."""
        if self.docs is not None:
            return self.distinct_blocks(block_size)
        assert self.chat is not None
        total = self.chat.conversations * -(-self.chat.history_tokens // block_size)
        if self.kind == "mixed":
            total += self.unique_requests() * -(-self.mean_prompt_tokens() // block_size)
        return total

    def longest_request_blocks(self, block_size: int) -> int:
        """Blocks of the longest prompt plus its answer: what one request holds at once."""
        if self.docs is not None:
            return -(-(self.docs.request_tokens + self.docs.answer_tokens) // block_size)
        assert self.chat is not None
        return -(-self.chat.history_tokens // block_size)

    def unique_requests(self) -> int:
        if self.kind != "mixed":
            return 0
        assert self.chat is not None
        chat = self.chat.conversations * self.chat.turns
        return round(chat * self.unique_share / (1.0 - self.unique_share))

    def describe(self) -> str:
        if self.docs is not None:
            d = self.docs
            return (
                f"docs: {d.requests} requests over {d.documents} documents of "
                f"{d.document_tokens} tokens (system {d.system_tokens}, question "
                f"{d.question_tokens}, answer {d.answer_tokens})"
            )
        assert self.chat is not None
        c = self.chat
        text = (
            f"{self.kind}: {c.conversations} conversations x {c.turns} turns (system "
            f"{c.system_tokens}, user {c.user_tokens}, answer {c.answer_tokens}; longest prompt "
            f"{c.prompt_tokens(c.turns)})"
        )
        if self.kind == "mixed":
            text += f" + {self.unique_requests()} unique prompts of {self.mean_prompt_tokens()}"
        return text

    def as_dict(self) -> dict[str, Any]:
        shape = self.docs if self.docs is not None else self.chat
        out: dict[str, Any] = {"kind": self.kind, **(shape.__dict__ if shape else {})}
        if self.kind == "mixed":
            out["unique_share"] = self.unique_share
            out["unique_requests"] = self.unique_requests()
        return out


def chat_turns(shape: ChatShape, vocab: int, seed: int = 0) -> list[Turn]:
    """Every turn of the chat workload, in the order the clients send them."""
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


def doc_turns(shape: DocShape, vocab: int, seed: int = 0) -> list[Turn]:
    """Requests that each pick one of the documents at random and ask their own question."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, shape.system_tokens)
    docs = [rng.integers(0, vocab, shape.document_tokens) for _ in range(shape.documents)]
    uses = [0] * shape.documents
    out = []
    for _ in range(shape.requests):
        d = int(rng.integers(0, shape.documents))
        uses[d] += 1
        question = rng.integers(0, vocab, shape.question_tokens)
        prompt = np.concatenate([system, docs[d], question])
        out.append(Turn(d, uses[d], prompt, rng.integers(0, vocab, shape.answer_tokens)))
    return out


def mix_in_unique(
    turns: list[Turn], share: float, prompt_tokens: int, vocab: int, seed: int
) -> list[Turn]:
    """``turns`` with unique prompts (``share`` of the result) inserted at random places."""
    rng = np.random.default_rng(seed + 7)
    count = round(len(turns) * share / (1.0 - share))
    unique = unique_turns(count, prompt_tokens, len(turns[0].answer), vocab, seed + 11)
    slots = set(rng.choice(len(turns) + count, count, replace=False).tolist())
    chat, mine = iter(turns), iter(unique)
    return [next(mine) if i in slots else next(chat) for i in range(len(turns) + count)]


def unique_turns(
    count: int, prompt_tokens: int, answer_tokens: int, vocab: int, seed: int
) -> list[Turn]:
    """``count`` requests of random tokens: no two share a block (the chance that a block of 16
    random ids repeats is about vocab ** -16)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        prompt = rng.integers(0, vocab, prompt_tokens)
        out.append(Turn(-1, 1, prompt, rng.integers(0, vocab, answer_tokens)))
    return out


def _positive(obj: object, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"expected {name} > 0, got {getattr(obj, name)}")


def _non_negative(obj: object, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ValueError(f"expected {name} >= 0, got {getattr(obj, name)}")
