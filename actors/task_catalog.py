"""The run's tasks: the training prompts in a stable order (the reconciler's task source) and the
held-out set, both derived from configuration alone so that every process agrees on them."""

from __future__ import annotations

from dataclasses import dataclass

from actors.config import TasksSection
from sandbox.long_context_tasks import generate_long_context_tasks
from sandbox.task_generator import generate_tasks
from sandbox.tasks import Task

__all__ = ["TaskCatalog"]


@dataclass(frozen=True)
class TaskCatalog:
    train: tuple[Task, ...]
    heldout: tuple[Task, ...]

    @classmethod
    def build(cls, section: TasksSection) -> TaskCatalog:
        def split(name: str, n: int) -> tuple[Task, ...]:
            n = n or section.count(name)
            if section.family == "long_context":
                return tuple(generate_long_context_tasks(section.seed, n, name))
            return tuple(generate_tasks(section.seed, n, name, section.difficulties))

        return cls(split("train", section.num_train), split("heldout", section.num_heldout))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {t.id: t for t in (*self.train, *self.heldout)})

    # TaskSource protocol (actors.reconciler.task_cursor): prompts by stable position.
    def __len__(self) -> int:
        return len(self.train)

    def prompt_id(self, position: int) -> str:
        return self.train[position].id

    def task(self, prompt_id: str) -> Task:
        try:
            return self._by_id[prompt_id]  # type: ignore[attr-defined]
        except KeyError:
            raise KeyError(f"task {prompt_id!r} is not in this run's task set; was the tasks config changed "
                           "between runs?") from None

