"""Every kind of run monim makes, in one list: the bare LM, the memorization policies and the
parametric learners, with what each does (help texts), the order reports and comparisons show them
in and how their numbers are shown, and the one rule between them (RandMem stores at MoNIM's rate
when both run)."""

from __future__ import annotations

from dataclasses import dataclass

BARE, MEMORY, LEARNER = "bare", "memory", "learner"  # the kinds of run
DEFAULT_RATE = 0.5  # RandMem's and KL's share where neither the run nor a followed MemRate sets it


@dataclass(frozen=True)
class PolicyInfo:
    """One run name: its kind, what it does, how its policy is made, and whose MemRate it follows."""

    name: str
    kind: str
    help: str
    make: str | None = None  # a memory policy's class in monim.learning.policies, params from the run's PolicyConfig
    adaptive: bool = False  # MoNIM: under the adaptive threshold (AMT)
    in_context: bool = False  # MoNIM: Θ reads each text after In-Context RALM's article
    follows: tuple[str, ...] = ()  # runs whose MemRate it stores at when they run too (the first present)
    reads: tuple[str, ...] = ()  # the PolicyConfig fields its policy reads (the ones its memory records)


CATALOGUE = (
    PolicyInfo("bare", BARE, "the LM alone"),
    PolicyInfo("fullmem", MEMORY, "every training token (the kNN-LM datastore)", "FullMem"),
    PolicyInfo("randmem", MEMORY, "a random share of the tokens (at MoNIM's rate when MoNIM runs too)", "RandMem",
          follows=("monim-amt", "monim"), reads=("rate",)),
    PolicyInfo("monim", MEMORY, "the tokens Θ predicts badly: log P < δ = -1.5", "MoNIM",
          reads=("delta", "search_margin", "search_context")),
    PolicyInfo("monim-amt", MEMORY, "MoNIM under the adaptive threshold (the default)", "MoNIM", adaptive=True,
          reads=("delta", "search_margin", "search_context")),
    PolicyInfo("ralm", MEMORY, "no kNN memory: the best BM25 article learned so far put before each `ralm_stride` tokens "
          "(In-Context RALM)", "InContext", reads=("ralm_stride", "ralm_query")),
    PolicyInfo("ralm+monim-amt", MEMORY, "In-Context RALM's article, with MoNIM-AMT's memory on top", "MoNIM",
          adaptive=True, in_context=True,
          reads=("delta", "search_margin", "search_context", "ralm_stride", "ralm_query")),
    PolicyInfo("kl", MEMORY, "the tokens whose key carries the most new information (the paper's appendix)", "KL",
          reads=("rate",)),
    PolicyInfo("greedy-merge", MEMORY, "every token, same-value neighbours merged into weighted entries", "GreedyMerge",
          reads=("merge_k",)),
    PolicyInfo("finetune", LEARNER, "each day, Adam on the day's articles from the previous day's weights"),
    PolicyInfo("mix-review", LEARNER, "fine-tuning with decaying general-domain text mixed in"),
    PolicyInfo("recadam", LEARNER, "fine-tuning with an annealed pull toward the pretrained weights"),
)
COMPARED = ("bare", "fullmem", "randmem", "monim-amt")  # what a comparison runs unless told
_BY_NAME = {e.name: e for e in CATALOGUE}


def policy_info(name: str) -> PolicyInfo:
    """A policy name's information, or a clear error listing the names."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def names(kind: str | None = None) -> list[str]:
    return [e.name for e in CATALOGUE if kind is None or e.kind == kind]


def help_text() -> str:
    """Every run name with what it does, for a command's help."""
    return "; ".join(f"{e.name}: {e.help}" for e in CATALOGUE) + "."


def shown_order(runs: list[str]) -> list[str]:
    """Run names (a '-const' suffix allowed) in the catalogue's order, unknown ones last."""
    def rank(name: str) -> tuple:
        base = name.removesuffix("-const")
        return (names().index(base) if base in _BY_NAME else len(CATALOGUE), name)

    return sorted(runs, key=rank)


def learning_order(runs: list[str]) -> list[str]:
    """The order a comparison learns its runs in: those another run follows first."""
    followed = {f for r in runs for f in policy_info(r).follows}
    return sorted(runs, key=lambda r: r not in followed)


def followed_memrate(name: str, memrates: dict[str, float]) -> float | None:
    """The MemRate a run stores at because it follows a run learned before it (RandMem: MoNIM's over
    the stream so far), or None."""
    leader = next((f for f in policy_info(name).follows if f in memrates), None)
    return round(memrates[leader], 4) if leader else None
