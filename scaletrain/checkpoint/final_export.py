"""The end of training's Hugging Face export (--export_hf_at_end): the folder written from the trained engine, then
completed on rank 0 with a generation config and a model card, so that it is publishable as it stands."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

from scaletrain.checkpoint.export import export_hf_model
from scaletrain.checkpoint.publish import complete_export
from scaletrain.checkpoint.run_folder import read_run_config
from scaletrain.model import merged_dir
from scaletrain.observability import MetricsLogger
from scaletrain.train import Callback, Order


@dataclass
class FinalExport(Callback):
    """After the final checkpoint: the export into the run folder (LoRA: the adapter, and with --merge_lora the
    merged model beside it), every rank taking part in gathering the weights."""

    order = Order.EXPORT

    engine: Any
    _: KW_ONLY
    tokenizer: Any
    model_config: Any
    output_dir: str
    is_main: bool
    merge_lora: bool
    trust_remote_code: bool
    metrics: MetricsLogger  # the final records the model card quotes

    def end_of_training(self, step: int) -> None:
        out, merged = self.output_dir, self.merge_lora
        export_hf_model(
            self.engine,
            tokenizer=self.tokenizer,
            out_dir=out,
            is_main=self.is_main,
            merge_lora=merged,
            trust_remote_code=self.trust_remote_code,
        )
        if self.is_main:  # the folder is complete and publishable
            run_config = read_run_config(out)
            for folder in (out, *([merged_dir(out)] if merged else [])):
                complete_export(
                    folder,
                    tokenizer=self.tokenizer,
                    model_config=self.model_config,
                    run_config=run_config,
                    final=self.metrics.latest,
                )
