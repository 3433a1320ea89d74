"""vLLM's `hf_overrides` that make a causal LM a classifier from its head's rows of some tokens: Qwen3-Reranker's
`{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": True}` scores a query-document pair by P(yes) of the softmax over "no" and "yes" at
the last token, which is the sigmoid of one label, logit(yes) - logit(no) (vLLM's method "from_2_way_softmax");
other token lists give one label per token, the head's logits of them."""
import torch

TWO_WAY = "from_2_way_softmax"


def resolve_classifier_from_token(hf_config, tokenizer):
    """The config's classifier_from_token as token ids (`classifier_from_token_ids`) and its labels; nothing where
    the config has none."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        return
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        hf_config.method = TWO_WAY
    two_way = getattr(hf_config, "method", None) == TWO_WAY
    if not isinstance(tokens, list | tuple) or not tokens or not all(isinstance(t, str) for t in tokens) or \
            (two_way and len(tokens) != 2):
        how_many = " (two: the false one, then the true one)" if two_way else ""
        raise ValueError(f"classifier_from_token must be a list of token strings{how_many}, got {tokens!r}")
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    unknown = [token for token, id_ in zip(tokens, ids) if id_ is None or id_ == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"classifier_from_token: the tokenizer has no token {unknown[0]!r}")
    hf_config.classifier_from_token_ids = ids
    hf_config.num_labels = 1 if two_way else len(tokens)


def score_weight(head: torch.Tensor, hf_config) -> torch.Tensor:
    """The score head's weight from the LM head's (or tied embedding's) rows. [num_labels, hidden]"""
    rows = head[hf_config.classifier_from_token_ids].float()
    return rows[1:] - rows[:1] if getattr(hf_config, "method", None) == TWO_WAY else rows
