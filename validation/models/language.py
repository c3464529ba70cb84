"""A CARMA BERT task (itu-rad/CARMA workloads/BERT_*_on_wiki.py): masked-LM pre-training from scratch on
random wikitext-shaped tokens.

    python validation/models/language.py bert_base --batch-size 32

As CARMA trained it, less the download: a `BertConfig` of the base or large size with the vocabulary of
`bert-large-cased` (28,996 tokens), sequences padded to 512 tokens, `DataCollatorForLanguageModeling`
(15% of tokens masked, by boolean masks) over a `BertTokenizer` made from a generated vocabulary of that
size, a model check on a random batch before training (CARMA's script ran one, with gradients on), AdamW
(lr 1e-4), `step()` then `zero_grad()`, the loss read with `.item()` every step.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForMaskedLM, BertTokenizer, DataCollatorForLanguageModeling

VOCAB = 28_996  # bert-large-cased's
SEQUENCE = 512
SAMPLES = 36_718  # wikitext-2-raw-v1's training lines
SIZES = {
    "bert_base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    "bert_large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
}
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class RandomTokens(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(len(SPECIAL), VOCAB, (SEQUENCE,))
        return {"input_ids": ids, "attention_mask": torch.ones(SEQUENCE, dtype=torch.long)}


def tokenizer(folder: Path) -> BertTokenizer:
    """A tokenizer of bert-large-cased's size, from a generated vocabulary: the collator asks it for the
    special tokens and the vocabulary size only."""
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join([*SPECIAL, *(f"t{i}" for i in range(VOCAB - len(SPECIAL)))]) + "\n")
    return BertTokenizer(str(vocab))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=SIZES)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as folder:
        collator = DataCollatorForLanguageModeling(tokenizer=tokenizer(Path(folder)), mlm=True, mlm_probability=0.15)
    loader = DataLoader(RandomTokens(), batch_size=args.batch_size, shuffle=True, collate_fn=collator)
    config = BertConfig(vocab_size=VOCAB, max_position_embeddings=SEQUENCE, **SIZES[args.model])
    model = BertForMaskedLM(config).to(device)
    model(torch.randint(0, VOCAB, (args.batch_size, SEQUENCE), device=device))  # CARMA's model check
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    for batch in loader:
        outputs = model(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            labels=batch["labels"].to(device),
        )
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.loss.item()


if __name__ == "__main__":
    main()
