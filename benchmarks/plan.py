"""Which processes the harness starts, in which order and on which GPUs. A process runs one group of workloads
(one workload, or with --group those that need the same engine arguments and GPU count) on one engine, each
workload with each of the engine's sampling variants in turn, after one start-up. A group's runs alternate the
engines' order (A B, B A, ...); with two GPU ids (--parallel-gpus) a one-GPU group's two runs of a repetition run
at the same time instead, one engine a GPU, the GPUs swapped every repetition.
"""
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from benchmarks.workloads import WORKLOADS, Workload


@dataclass
class Engine:
    label: str
    folder: str
    extra_args: dict
    sampling: list[str] = field(default_factory=lambda: ["plain"])  # the variants it runs, plain first


@dataclass
class Task:
    """One workload with one sampling variant: a warm-up and a timed generate in a process."""
    workload: Workload
    sampling: str = "plain"

    @property
    def key(self) -> tuple[str, str]:
        return self.workload.name, self.sampling

    @property
    def name(self) -> str:
        """For file names: the workload's for plain, else workload.variant."""
        return self.workload.name if self.sampling == "plain" else f"{self.workload.name}.{self.sampling}"

    @property
    def label(self) -> str:
        """For messages: the workload's for plain, else "workload (variant)"."""
        return self.workload.name if self.sampling == "plain" else f"{self.workload.name} ({self.sampling})"


@dataclass
class Group:
    """Workloads that one process runs after one engine start-up; they share engine arguments and GPUs."""
    workloads: list[Workload]

    @property
    def name(self) -> str:
        return ".".join(w.name for w in self.workloads)  # a one-workload group is named after its workload

    @property
    def engine_kwargs(self) -> dict:
        return self.workloads[0].engine_kwargs

    @property
    def num_gpus(self) -> int:
        return self.workloads[0].num_gpus


def make_groups(workloads: list[Workload], group: bool) -> list[Group]:
    """One group per workload, in the given order; with `group`, one per distinct (engine arguments, GPU
    count), its workloads and the groups in the order of WORKLOADS."""
    if not group:
        return [Group([w]) for w in workloads]
    groups: dict[str, Group] = {}
    for workload in sorted(workloads, key=lambda w: list(WORKLOADS).index(w.name)):
        key = json.dumps([workload.engine_kwargs, workload.num_gpus], sort_keys=True)
        groups.setdefault(key, Group([])).workloads.append(workload)
    return list(groups.values())


@dataclass
class Process:
    """One engine's run of one group, in a new process; pinned with CUDA_VISIBLE_DEVICES=gpus when set."""
    engine: Engine
    group: Group
    run: int  # from 0
    gpus: str | None

    @property
    def name(self) -> str:
        return f"{self.group.name}-{self.engine.label}-{self.run + 1}"

    @property
    def engine_args(self) -> dict:
        return {**self.group.engine_kwargs, **self.engine.extra_args}

    @property
    def tasks(self) -> list[Task]:
        """What it runs in turn: each workload of the group with each of the engine's sampling variants."""
        return [Task(workload, variant) for workload in self.group.workloads for variant in self.engine.sampling]


def interleaved(engines: list[Engine], run: int) -> list[Engine]:
    """A B on even runs, B A on odd ones, so drift and cache warming fall on both engines alike."""
    return engines if run % 2 == 0 else engines[::-1]


def schedule(engines: list[Engine], group: Group, num_runs: int, gpu_ids: list[str] | None) -> Iterator[list[Process]]:
    """The group's processes in batches; a batch's processes run at the same time. With two `gpu_ids`, a
    one-GPU group's batch holds every engine's run of a repetition, engine i on gpu_ids[(i + run) % 2];
    otherwise each batch is one process, interleaved, with every id in `gpu_ids` visible."""
    for run in range(num_runs):
        if gpu_ids and group.num_gpus == 1:
            yield [Process(engine, group, run, gpu_ids[(i + run) % 2]) for i, engine in enumerate(engines)]
        else:
            for engine in interleaved(engines, run):
                yield [Process(engine, group, run, ",".join(gpu_ids) if gpu_ids else None)]
