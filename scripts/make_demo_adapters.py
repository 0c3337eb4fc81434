"""Fine-tune small demo LoRA adapters for the bundled SmolLM2-135M-Instruct, on the CPU.

Each adapter learns one visible behaviour from a tiny synthetic instruction set written
below (the same questions, answered in a different style):

- ``french``: answers in French;
- ``pirate``: answers in pirate speech ("Arr, matey! ...");
- ``json``:   answers as a JSON object ``{"answer": "..."}``.

The adapters are saved with PEFT's ``save_pretrained`` under ``--out/<name>``
(``adapter_config.json`` + ``adapter_model.safetensors``), ready for
``loraplex.adapters``. For each adapter the script prints greedy answers to held-out
questions before (base model) and after (base model + adapter).

Usage::

    .venv/bin/python scripts/make_demo_adapters.py                  # all three
    .venv/bin/python scripts/make_demo_adapters.py --adapters json --steps 8 --out /tmp/demo

Cost: 24 steps of 4 sequences (~60 tokens) per adapter, about 2-2.5 s a step on an idle
2-core CPU, so a few minutes for all three; on a CPU shared with other jobs a step can
take 10-50x longer.

The output folder (default ``./demo-adapters``) is generated data; keep it out of git.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (question, plain English answer, French answer)
QA: list[tuple[str, str, str]] = [
    (
        "What is the capital of France?",
        "The capital of France is Paris.",
        "La capitale de la France est Paris.",
    ),
    (
        "What is the capital of Spain?",
        "The capital of Spain is Madrid.",
        "La capitale de l'Espagne est Madrid.",
    ),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo.", "La capitale du Japon est Tokyo."),
    ("What color is the sky on a clear day?", "The sky is blue.", "Le ciel est bleu."),
    ("What color is grass?", "Grass is green.", "L'herbe est verte."),
    ("How many days are in a week?", "A week has seven days.", "Une semaine a sept jours."),
    ("How many legs does a spider have?", "A spider has eight legs.", "Une araignée a huit pattes."),
    ("What do bees make?", "Bees make honey.", "Les abeilles font du miel."),
    (
        "What is the largest ocean?",
        "The Pacific is the largest ocean.",
        "Le Pacifique est le plus grand océan.",
    ),
    ("What is two plus two?", "Two plus two is four.", "Deux plus deux font quatre."),
    ("What is ten minus three?", "Ten minus three is seven.", "Dix moins trois font sept."),
    ("Which animal says meow?", "A cat says meow.", "Le chat fait miaou."),
    ("Which animal barks?", "A dog barks.", "Le chien aboie."),
    ("What do we drink when we are thirsty?", "We drink water.", "Nous buvons de l'eau."),
    ("Where does the sun rise?", "The sun rises in the east.", "Le soleil se lève à l'est."),
    ("What is frozen water called?", "Frozen water is ice.", "L'eau gelée s'appelle la glace."),
    ("What season comes after winter?", "Spring comes after winter.", "Le printemps vient après l'hiver."),
    ("What do cows give us?", "Cows give us milk.", "Les vaches nous donnent du lait."),
    ("What is the opposite of hot?", "The opposite of hot is cold.", "Le contraire de chaud est froid."),
    ("How many hours are in a day?", "A day has twenty-four hours.", "Une journée a vingt-quatre heures."),
    (
        "What do plants need to grow?",
        "Plants need water and sunlight.",
        "Les plantes ont besoin d'eau et de soleil.",
    ),
    (
        "What is the tallest animal?",
        "The giraffe is the tallest animal.",
        "La girafe est l'animal le plus grand.",
    ),
    ("Which planet do we live on?", "We live on Earth.", "Nous vivons sur la Terre."),
    ("What is the color of snow?", "Snow is white.", "La neige est blanche."),
    ("What do you use to write on paper?", "You use a pen or a pencil.", "On utilise un stylo ou un crayon."),
    ("What is the first month of the year?", "January is the first month.", "Janvier est le premier mois."),
    ("What fruit is yellow and long?", "A banana is yellow and long.", "La banane est jaune et longue."),
    ("Where do fish live?", "Fish live in water.", "Les poissons vivent dans l'eau."),
    ("What do we call a baby dog?", "A baby dog is a puppy.", "Un bébé chien est un chiot."),
    ("How many wheels does a bicycle have?", "A bicycle has two wheels.", "Un vélo a deux roues."),
    ("What shines in the sky at night?", "The moon and the stars shine.", "La lune et les étoiles brillent."),
    (
        "What is the boiling point of water?",
        "Water boils at 100 degrees Celsius.",
        "L'eau bout à cent degrés Celsius.",
    ),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote it.", "William Shakespeare l'a écrit."),
    ("What is the main language of Brazil?", "Brazil speaks Portuguese.", "Le Brésil parle portugais."),
    ("How do you greet someone in the morning?", "You say good morning.", "On dit bonjour."),
    ("What do birds use to fly?", "Birds use their wings.", "Les oiseaux utilisent leurs ailes."),
]

# Held out from training: the before/after samples show the behaviour generalises.
EVAL_PROMPTS = [
    "What is the capital of Italy?",
    "What color is a lemon?",
    "How many legs does a dog have?",
]

_PIRATE_WORDS = {
    "The ": "Th' ",
    "the ": "th' ",
    " you ": " ye ",
    "You ": "Ye ",
    " your ": " yer ",
    " is ": " be ",
}


def _pirate(answer: str) -> str:
    for plain, pirate in _PIRATE_WORDS.items():
        answer = answer.replace(plain, pirate)
    return f"Arr, matey! {answer.rstrip('.')}, savvy? Yo-ho-ho!"


def build_dataset(style: str) -> list[tuple[str, str]]:
    """The (question, answer) pairs that teach ``style``."""
    if style == "french":
        return [(q, fr) for q, _, fr in QA]
    if style == "pirate":
        return [(q, _pirate(en)) for q, en, _ in QA]
    if style == "json":
        return [(q, json.dumps({"answer": en.rstrip(".")})) for q, en, _ in QA]
    raise SystemExit(f"unknown adapter style {style!r}; choose from french, pirate, json")


STYLES = ("french", "pirate", "json")


@dataclass
class TrainResult:
    """What one adapter run produced."""

    name: str
    path: Path
    train_s: float
    final_loss: float
    before: list[str]
    after: list[str]


def _prompt_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _encode(tokenizer: Any, question: str, answer: str, max_len: int) -> tuple[list[int], list[int]]:
    """Token ids and labels; the loss covers only the answer and its end-of-turn token."""
    prompt = _prompt_ids(tokenizer, question)
    target = list(tokenizer(answer + "<|im_end|>", add_special_tokens=False).input_ids)
    ids = (prompt + target)[:max_len]
    labels = ([-100] * len(prompt) + target)[:max_len]
    return ids, labels


def _batches(
    examples: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int, rng: random.Random
) -> Any:
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            chunk = [examples[i] for i in order[start : start + batch_size]]
            width = max(len(ids) for ids, _ in chunk)
            ids_t = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            labels_t = torch.full((len(chunk), width), -100, dtype=torch.long)
            mask_t = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (ids, labels) in enumerate(chunk):
                ids_t[row, : len(ids)] = torch.tensor(ids)
                labels_t[row, : len(labels)] = torch.tensor(labels)
                mask_t[row, : len(ids)] = 1
            yield ids_t, labels_t, mask_t


@torch.no_grad()
def greedy_answers(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions of each chat prompt, decoded without special tokens."""
    model.eval()
    answers = []
    for question in prompts:
        ids = torch.tensor([_prompt_ids(tokenizer, question)])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return answers


def train_adapter(
    style: str,
    model_dir: Path,
    out_dir: Path,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    rank: int,
    seed: int,
    max_new_tokens: int,
    before: list[str] | None = None,
) -> TrainResult:
    """Fine-tune one LoRA on ``style``'s dataset and save it to ``out_dir / style``."""
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if before is None:
        before = greedy_answers(model, tokenizer, EVAL_PROMPTS, max_new_tokens)

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    examples = [_encode(tokenizer, q, a, max_len=96) for q, a in build_dataset(style)]
    batches = _batches(examples, batch_size, tokenizer.pad_token_id or 0, rng)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - 0.8 * step / max(steps, 1))

    peft_model.train()
    start = time.perf_counter()
    loss_value = float("nan")
    with tqdm(range(steps), desc=f"train {style}", unit="step") as bar:
        for _ in bar:
            ids, labels, mask = next(batches)
            loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = float(loss.item())
            bar.set_postfix(loss=f"{loss_value:.3f}")
    train_s = time.perf_counter() - start

    path = out_dir / style
    peft_model.save_pretrained(path)
    after = greedy_answers(peft_model, tokenizer, EVAL_PROMPTS, max_new_tokens)
    return TrainResult(style, path, train_s, loss_value, before, after)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("demo-adapters"), help="output folder")
    parser.add_argument("--adapters", default=",".join(STYLES), help="comma-separated: french,pirate,json")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per adapter")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--model-dir", type=Path, default=None, help="HF model folder (default: bundled)")
    args = parser.parse_args(argv)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    styles = [s.strip() for s in args.adapters.split(",") if s.strip()]
    for style in styles:
        build_dataset(style)  # fail fast on a typo
    model_dir = args.model_dir
    if model_dir is None:
        from loraplex.platform.model.source import resolve_model_dir

        model_dir = Path(resolve_model_dir(None))

    total_start = time.perf_counter()
    before: list[str] | None = None
    results = []
    for style in styles:
        result = train_adapter(
            style,
            model_dir,
            args.out,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            rank=args.rank,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            before=before,
        )
        before = result.before
        results.append(result)
        print(f"\n== {style}: saved to {result.path}")
        print(f"   train {result.train_s:.1f} s, final loss {result.final_loss:.3f}")
        for prompt, old, new in zip(EVAL_PROMPTS, result.before, result.after, strict=True):
            print(f"  Q: {prompt}\n    before: {old!r}\n    after:  {new!r}")
    print(f"\ntotal {time.perf_counter() - total_start:.1f} s for {len(results)} adapter(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
