"""Where a timed run's host work ran, from /proc (Linux): each thread's CPU time and the main thread's involuntary
context switches (time the kernel gave its processor to something else), and the processors the main thread ran on,
so that a process whose host loop runs slower than another's on the same work can be told apart by where it ran
and what ran beside it. Standard library only: `run_one.py` imports it beside the engine under test.
"""
import os
import threading
import time

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_snapshot() -> dict[int, dict]:
    """This process's threads by id: name, CPU seconds (user and system), involuntary switches, last processor."""
    snapshot = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                name, rest = f.read().rsplit(")", 1)  # the name may hold spaces and parentheses
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile (gone, or exiting: ESRCH)
            continue
        fields = rest.split()  # from the stat file's third field on
        snapshot[int(tid)] = dict(name=name.split("(", 1)[1], cpu_s=(int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
                                  involuntary=int(status["nonvoluntary_ctxt_switches"]), processor=int(fields[36]))
    return snapshot


class HostSampler:
    """While the block runs, the main thread's processor every `interval` seconds; `summary()` after it."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.processors, self.stopped = interval, {}, threading.Event()
        self.sampler_cpu_s = 0.0

    def __enter__(self) -> "HostSampler":
        self.main_tid, self.before = threading.get_native_id(), thread_snapshot()
        self.main_before, self.process_before = time.thread_time(), time.process_time()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        return self

    def _sample(self):
        try:
            while not self.stopped.wait(self.interval):
                with open(f"/proc/self/task/{self.main_tid}/stat") as f:
                    processor = int(f.read().rsplit(")", 1)[1].split()[36])
                self.processors[processor] = self.processors.get(processor, 0) + 1
        finally:
            self.sampler_cpu_s = time.thread_time()  # the thread ends here, and /proc forgets it

    def __exit__(self, *exc_info):
        self.stopped.set()
        self.sampler.join()
        self.main_after, self.process_after, self.after = time.thread_time(), time.process_time(), thread_snapshot()

    def summary(self) -> dict:
        """The main thread's CPU seconds, involuntary switches and processors (share of samples); the other
        threads' CPU seconds (the process's less the main thread's and the sampler's, threads that ended
        included, from the kernel's exact clocks), and by name those still running that took at least 10 ms
        (from /proc, in clock ticks); the load average after the run."""
        busy = {tid: thread["cpu_s"] - self.before.get(tid, {"cpu_s": 0.0})["cpu_s"]
                for tid, thread in self.after.items()}
        by_name: dict[str, float] = {}
        for tid, seconds in busy.items():
            if tid != self.main_tid and seconds >= 0.01:
                name = self.after[tid]["name"]
                by_name[name] = round(by_name.get(name, 0.0) + seconds, 2)
        main_cpu_s = self.main_after - self.main_before
        others = self.process_after - self.process_before - main_cpu_s - self.sampler_cpu_s
        switches = self.after[self.main_tid]["involuntary"] - self.before[self.main_tid]["involuntary"]
        samples = sum(self.processors.values()) or 1
        return dict(main_cpu_s=round(main_cpu_s, 2), main_involuntary_switches=switches,
                    main_processors={cpu: round(n / samples, 2) for cpu, n in sorted(self.processors.items())},
                    other_threads_cpu_s=round(max(others, 0.0), 2), busiest_other_threads=by_name,
                    loadavg=os.getloadavg())
