"""A tiny word-level tokenizer and a pre-tokenised dataset of random sequences for the TRL tests."""
import torch

from hf_models import VOCAB


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")),
                                        pad_token="t0", eos_token="t2", unk_token="t1")
    return tokenizer


def _dataset(rows=12):
    import datasets
    generator = torch.Generator().manual_seed(7)
    lengths = torch.randint(6, 13, (rows,), generator=generator).tolist()
    ids = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids})
