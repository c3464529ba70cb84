"""CARMA's GPT-2 task (itu-rad/CARMA workloads/gpt2_large_on_wiki.py): causal-LM pre-training from scratch,
under `torch.nn.DataParallel` on two GPUs, on random wikitext-shaped tokens.

    python validation/models/gpt2.py --batch-size 8

As CARMA trained it, less the download: GPT-2 large's configuration (36 layers, 1280 wide, 20 heads,
`gelu_new`, dropout 0.1) with gpt2-large's vocabulary (50,257 tokens), lines padded to 512 tokens, the
model wrapped in DataParallel (which splits each batch between the GPUs), a check on a random batch before
training with gradients on, AdamW (lr 1e-4), `loss.mean()` over the replicas' losses, `step()` then
`zero_grad()`, the loss read with `.item()` every step. CARMA's script also printed a model summary
(modelsummary's forward pass), left out. Each line's length is drawn as wikitext-2's are mostly short: the
padding is masked, so the attention mask has zeros, as it has on the real data.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 50_257  # gpt2-large's tokenizer
SEQUENCE = 512
SAMPLES = 36_718  # wikitext-2-raw-v1's training lines


class RandomLines(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        length = int(torch.randint(1, SEQUENCE + 1, ()))
        ids = torch.full((SEQUENCE,), VOCAB - 1)  # the eos token pads, as CARMA's pad_token = eos_token
        ids[:length] = torch.randint(0, VOCAB - 1, (length,))
        mask = torch.zeros(SEQUENCE, dtype=torch.long)
        mask[:length] = 1
        return {"input_ids": ids, "attention_mask": mask}


def config() -> GPT2Config:
    """CARMA's GPT2Config: GPT-2 large's sizes."""
    return GPT2Config(
        vocab_size=VOCAB, n_positions=1024, n_embd=1280, n_layer=36, n_head=20, activation_function="gelu_new",
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loader = DataLoader(RandomLines(), batch_size=args.batch_size, shuffle=True)
    model = torch.nn.DataParallel(GPT2LMHeadModel(config())).to(device)
    model(torch.randint(0, VOCAB, (args.batch_size, SEQUENCE), device=device))  # CARMA's model check
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    for batch in loader:
        input_ids = batch["input_ids"].to(device)
        outputs = model(input_ids=input_ids, attention_mask=batch["attention_mask"].to(device), labels=input_ids)
        loss = outputs.loss.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()


if __name__ == "__main__":
    main()
