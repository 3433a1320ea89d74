"""vLLM's FlexibleArgumentParser (`from nanovllm.utils import FlexibleArgumentParser`, or from here, where
recent vLLM keeps it): `--max-model-len` and `--max_model_len` alike. Booleans take `--flag` and `--no-flag`
(`EngineArgs.add_cli_args`)."""
import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([dashed(arg) for arg in args], namespace)


def dashed(arg: str) -> str:
    """A long option with underscores as dashes (`--a_b=c_d` -> `--a-b=c_d`); anything else as it is."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value
