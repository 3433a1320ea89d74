"""As vLLM's metrics.py: LLM(model=..., disable_log_stats=False), generate(), then every record of
get_metrics() printed by its type (nanovllm.metrics for vllm.v1.metrics.reader)."""
from nanovllm import LLM, SamplingParams
from nanovllm.metrics import Counter, Gauge, Histogram, Vector


def main():
    llm = LLM(model="TINY_MODEL", disable_log_stats=False)
    llm.generate(["Hello, my name is", "The capital of France is"], SamplingParams(temperature=0.8, top_p=0.95))
    for metric in llm.get_metrics():
        if isinstance(metric, Gauge):
            print(f"{metric.name} (gauge) = {metric.value}")
        elif isinstance(metric, Counter):
            print(f"{metric.name} (counter) = {metric.value}")
        elif isinstance(metric, Vector):
            print(f"{metric.name} (vector) = {metric.values}")
        elif isinstance(metric, Histogram):
            print(f"{metric.name} (histogram) sum = {metric.sum} count = {metric.count}")
            for bucket_le, value in metric.buckets.items():
                print(f"    {bucket_le} = {value}")


if __name__ == "__main__":
    main()
