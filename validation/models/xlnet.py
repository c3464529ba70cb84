"""A CARMA XLNet task (itu-rad/CARMA workloads/xlnet_*_cased.py): sequence classification fine-tuned by
Hugging Face's Trainer on two GPUs, on random wikitext-shaped tokens.

    python validation/models/xlnet.py xlnet_base --batch-size 8

As CARMA trained it, less the downloads: `XLNetForSequenceClassification` of the base or large size
(xlnet-base-cased's and xlnet-large-cased's configurations, 32,000 tokens, two labels, every label 1),
Trainer's defaults (AdamW, lr 5e-5, a linear schedule, no evaluation, logging or checkpoints), each device
given `--batch-size` lines (Trainer wraps the model in DataParallel when `torch.cuda.device_count()` is above
1 and hands each GPU its share: captured with `carma estimate --gpus 2`, it does). CARMA padded each batch to
its longest line, truncated at 512 tokens; wikitext-2 has lines longer than that, so every epoch meets batches
of 512: here every line has 512 tokens, the GPU run's longest batch. CARMA's script also ran a model check and
a summary before the Trainer, on a batch of 8 (`model(ids)` with gradients on, whose outputs it drops): kept,
the summary left out.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments, XLNetConfig, XLNetForSequenceClassification

VOCAB = 32_000  # xlnet-*-cased's sentencepiece vocabulary
SEQUENCE = 512
SAMPLES = 36_718  # wikitext-2-raw-v1's training lines
SIZES = {
    "xlnet_base": {"d_model": 768, "n_layer": 12, "n_head": 12, "d_inner": 3072},
    "xlnet_large": {"d_model": 1024, "n_layer": 24, "n_head": 16, "d_inner": 4096},
}
EPOCHS = {"xlnet_base": 8, "xlnet_large": 3}


class RandomLines(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(5, VOCAB, (SEQUENCE,)),
            "token_type_ids": torch.zeros(SEQUENCE, dtype=torch.long),
            "attention_mask": torch.ones(SEQUENCE, dtype=torch.long),
            "labels": torch.tensor(1),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=SIZES)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = XLNetConfig(vocab_size=VOCAB, num_labels=2, **SIZES[args.model])
    model = XLNetForSequenceClassification(config).to(device)
    model(torch.randint(0, VOCAB, (8, SEQUENCE), device=device))  # CARMA's model check
    with tempfile.TemporaryDirectory() as output:
        training = TrainingArguments(
            output_dir=output, num_train_epochs=EPOCHS[args.model], per_device_train_batch_size=args.batch_size,
            eval_strategy="no", save_strategy="no", logging_strategy="no", report_to=[],
        )  # fmt: skip
        Trainer(model=model, args=training, train_dataset=RandomLines()).train()


if __name__ == "__main__":
    main()
