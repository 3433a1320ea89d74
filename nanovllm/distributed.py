"""vLLM's `cleanup_dist_env_and_memory`, which its scripts call between two engines in one process."""
import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False):
    """Collect the engines no longer referenced (their processes, shared memory and GPU memory go with
    them), then hand the CUDA allocator's cached memory back. Ray, where asked, is shut down."""
    gc.collect()
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if shutdown_ray:
        import ray
        ray.shutdown()
