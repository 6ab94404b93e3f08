"""The registered policy as an MLflow pyfunc model, logged from this file ("models from code").

MLflow copies this file into every logged policy model and runs it when the model is loaded, so it imports nothing
from vime-flow: a teammate needs only mlflow, torch and transformers to call
`mlflow.pyfunc.load_model("models:/<name>@champion").predict(...)`. The weights are the model's artifact `weights`
(an HF checkpoint directory), or, for a large export in a local store, `weights_ref`: a JSON file naming the
directory on the disk that trained it.

Input: a DataFrame (or list of dicts) with a `prompt` column of user messages; output: one `completion` per prompt,
greedy, rendered with the tokenizer's chat template as training rendered its prompts (data.apply_chat_template).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel


def weights_dir(artifacts: dict[str, str]) -> Path:
    """The HF checkpoint directory of a loaded policy model's artifacts."""
    if "weights" in artifacts:
        return Path(artifacts["weights"])
    return Path(json.loads(Path(artifacts["weights_ref"]).read_text())["path"])


class PolicyModel(PythonModel):
    def load_context(self, context) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = weights_dir(context.artifacts)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()

    # DataFrame: the type pyfunc hands over under our explicit signature; MLflow infers nothing from it (any other
    # hint would replace the signature, none at all warns on every load)
    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> list[str]:
        import torch

        rows = model_input.to_dict("records")
        max_new_tokens = int((params or {}).get("max_new_tokens", 64))
        out = []
        for row in rows:
            text = row["prompt"]
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
                )
            ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                gen = self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            out.append(self.tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
        return out


mlflow.models.set_model(PolicyModel())
