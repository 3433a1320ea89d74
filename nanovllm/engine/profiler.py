"""vLLM's profiling hooks: `LLM(..., profiler_config={"profiler": "torch", "torch_profiler_dir": DIR})` (or
$VLLM_TORCH_PROFILER_DIR), then `start_profile()` and `stop_profile()` around the calls to look at. The
torch profiler records the engine's process (the host and, on CUDA, rank 0's kernels) and writes a gzipped
Chrome trace (`*.pt.trace.json.gz`, which Perfetto opens) into DIR when it stops."""
import os


class EngineProfiler:

    def __init__(self, profiler_config: dict | None):
        config = dict(profiler_config or {})
        if not config and os.environ.get("VLLM_TORCH_PROFILER_DIR"):
            config = {"profiler": "torch", "torch_profiler_dir": os.environ["VLLM_TORCH_PROFILER_DIR"]}
        if config and (config.get("profiler") != "torch" or not config.get("torch_profiler_dir")):
            raise ValueError(f"profiler_config={profiler_config!r}: give {{'profiler': 'torch', "
                             f"'torch_profiler_dir': DIR}}, the profiler this engine has")
        self.directory = config and os.path.abspath(os.path.expanduser(config["torch_profiler_dir"]))
        self.running = None

    def start(self):
        import torch
        if not self.directory:
            raise RuntimeError("the profiler is not enabled: create the engine with profiler_config="
                               "{'profiler': 'torch', 'torch_profiler_dir': DIR} (or set VLLM_TORCH_PROFILER_DIR)")
        if self.running is not None:
            raise RuntimeError("the profiler is running already: stop_profile() first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(self.directory, exist_ok=True)
        handler = torch.profiler.tensorboard_trace_handler(self.directory, worker_name="rank0", use_gzip=True)
        self.running = torch.profiler.profile(activities=activities, on_trace_ready=handler)
        self.running.start()

    def stop(self):
        if self.running is None:
            raise RuntimeError("the profiler is not running: start_profile() first")
        running, self.running = self.running, None
        running.stop()
