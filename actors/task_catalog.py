"""The run's tasks: the training prompts in a stable order (the reconciler's task source) and the
held-out set, both derived from configuration alone so that every process agrees on them."""

from __future__ import annotations

from dataclasses import dataclass

from actors.config import TasksSection
from actors.task_sources import family_tasks
from sandbox.tasks import Task

__all__ = ["TaskCatalog"]


@dataclass(frozen=True)
class TaskCatalog:
    train: tuple[Task, ...]
    heldout: tuple[Task, ...]

    @classmethod
    def build(cls, section: TasksSection) -> TaskCatalog:
        """The training and held-out tasks ``section`` names (`actors.task_sources`).

        Raises:
            ValueError: a task id in both splits (tasks from two families that share ids).
        """
        def split(name: str, n: int) -> tuple[Task, ...]:
            return family_tasks(section.family_of(name), name, section.seed, n, difficulties=section.difficulties,
                                path=section.path, cache_dir=section.cache_dir)

        train, heldout = split("train", section.num_train), split("heldout", section.num_heldout)
        shared = sorted({t.id for t in train} & {t.id for t in heldout})
        if shared:
            raise ValueError(f"task ids {shared[:5]} are in both the training and the held-out tasks "
                             f"(tasks.family={section.family!r}, tasks.heldout_family={section.heldout_family!r}); "
                             "rename them: a held-out task must never be trained on")
        return cls(train, heldout)

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

