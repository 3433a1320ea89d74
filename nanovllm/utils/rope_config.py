"""The rotary embedding's parameters as a model's config gives them, read and checked (the layer that computes
the rotation is `layers/rotary_embedding.py`)."""
import math

ROPE_TYPES = ("default", "llama3")


def rope_parameters(config) -> dict:
    """The rotary's parameters: newer configs carry a `rope_parameters` dict, older ones `rope_theta` and
    `rope_scaling`. A rope type other than ROPE_TYPES raises ValueError."""
    parameters = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    parameters["rope_type"] = parameters.get("rope_type", parameters.get("type", "default"))
    if parameters["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope type {parameters['rope_type']!r} is not supported, only {', '.join(ROPE_TYPES)}")
    numbers = ["rope_theta"] + (LLAMA3_FIELDS if parameters["rope_type"] == "llama3" else [])
    bad = next((name for name in numbers if not is_positive_number(parameters.get(name))), None)
    if bad is not None:  # 0 or less would make every rotation NaN
        raise ValueError(f"the rope's {bad} must be a positive number, got {parameters.get(bad)!r}")
    if parameters["rope_type"] == "llama3" and parameters["low_freq_factor"] >= parameters["high_freq_factor"]:
        raise ValueError(f"the rope's low_freq_factor={parameters['low_freq_factor']} must be below its "
                         f"high_freq_factor={parameters['high_freq_factor']}")
    return parameters


LLAMA3_FIELDS = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]


def is_positive_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
