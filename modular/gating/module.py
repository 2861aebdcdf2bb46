"""The gated LightningModule: behaviours work in the open state and fail when their direction is ablated,
while retain data matches the frozen reference model in every state. Its options are the lock's; the other
families are groups of their own (:mod:`modular.gating.options`), and head gates a plug-in
(:mod:`modular.gating.head_gates`)."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from safetensors.torch import save_file

from modular import ModularError
from modular.data import behaviour_name
from modular.directions import choose_directions, load_avoided_directions
from modular.files import atomic_path
from modular.gating.batching import concat_left_padded
from modular.gating.data import data_max_length
from modular.gating.head_gates import HeadGateOptions, HeadGates, gate_parameters
from modular.gating.loaders import loader_states_fit
from modular.gating.objectives import StepContext, Term, TermSetup, build_objectives, no_terms_given
from modular.gating.options import (
    DirectionOptions,
    FineTuningOptions,
    MemoryOptions,
    OptimizerOptions,
    SteeringOptions,
    build_groups,
    plain,
)
from modular.gating.randomness import global_random_state, set_global_random_state
from modular.gating.requirements import Requirement, requirements_of
from modular.gating.steering import SteeringAdversary
from modular.gating.step import StepRunner
from modular.hooks import ablate_directions, enable_checkpointing
from modular.models import empty_model, load_model
from modular.models.adapter import ArchitectureAdapter
from modular.models.compiled import compile_blocks
from modular.models.lora import with_lora
from modular.optim import adamw
from modular.runs import DIRECTIONS, read_directions

log = logging.getLogger("modular")

__all__ = ["GatedLM", "check_model_options", "concat_left_padded"]

#: the module's option groups (``model.<group>``, a mapping each): group -> its dataclass; ``steering`` and
#: ``head_gates`` are off when null, the others take their defaults
OPTION_GROUPS = {"direction": DirectionOptions, "finetuning": FineTuningOptions, "optimizer": OptimizerOptions,
                 "steering": SteeringOptions, "head_gates": HeadGateOptions, "memory": MemoryOptions}
_OPTIONAL = ("steering", "head_gates")


def check_model_options(options) -> dict:
    """One line for the first bad model option (``options``: a parsed config's ``model``, or the module's arguments),
    before anything is loaded; the option groups, built (:data:`OPTION_GROUPS`)."""
    locked_weight = options.get("locked_weight")
    if locked_weight is not None and locked_weight < 0:
        raise ModularError(f"model.locked_weight must be >= 0, got {locked_weight}")
    build_objectives(options.get("objectives"))  # a bad term option: one line, before anything loads
    groups = build_groups(options, OPTION_GROUPS, _OPTIONAL)
    if groups["finetuning"].mode == "none" and groups["head_gates"] is None:
        raise ModularError("model.finetuning.mode 'none' trains nothing without head_gates")
    if groups["head_gates"] is not None and groups["memory"].gradient_checkpointing:
        # the gates' scopes are module state, not hooks: a recomputed block would not see them
        raise ModularError("model.memory.gradient_checkpointing is not available with head_gates")
    memory = groups["memory"]
    if memory.compile and (groups["head_gates"] is not None or memory.gradient_checkpointing):
        raise ModularError("model.memory.compile is not available with head_gates or gradient_checkpointing")
    return groups


class GatedLM(L.LightningModule):
    """Fine-tunes a causal LM so that each gated behaviour lives in its own residual direction, optionally with
    hard-concrete head gates under a sparsity pressure (sparse post-training: :mod:`modular.gating.head_gates`).

    Args:
        model_name: Model reference: built-in alias, .gguf file, local HF folder or hub id.
        load_dtype: Precision the base weights are loaded in (on the CPU; Lightning then moves them to the
            trainer's device): ``float32`` (default; for ``trainer.precision`` 32-true or bf16-mixed, which keep
            float32 master weights), ``bfloat16`` (for ``bf16-true``: half the host memory of a large model) or
            ``float16``.
        behaviours: Behaviours to gate (one direction each); must match the data's behaviours; may be empty. Built-in
            names, .jsonl files (named by their stem), hf:<dataset>, or NAME=<.jsonl file or hf:dataset>; the short
            name names the metrics, the direction and the key.
        direction: How each behaviour's direction is chosen (:class:`~modular.gating.options.DirectionOptions`).
        objectives: The terms of the loss (class paths, :mod:`modular.gating.objectives`): the open answers, the
            locked state, keeping the reference on retain, neighbour and raw text, the direction write term, the
            refusal guard, the tasks and the head-gate terms; each with its own weight and options. Default: the
            lock's terms at weight 1 (answers, locked refusal, retain KL, LM text, tasks).
        locked_weight: λ, the weight of every locked-state piece on top of its term's weight.
        finetuning: Which weights train: all, LoRA adapters or none
            (:class:`~modular.gating.options.FineTuningOptions`).
        optimizer: The weights' AdamW (:class:`~modular.gating.options.OptimizerOptions`).
        seed: Seed of direction choice and of state assignment.
        steering: Train the lock to hold under difference-in-means steering
            (:class:`~modular.gating.options.SteeringOptions`); null: off.
        head_gates: Hard-concrete gates on every attention head, their sparsity pressure and scope
            (:class:`~modular.gating.head_gates.HeadGateOptions`); null: no gates.
        memory: Gradient checkpointing and FSDP2's empty init, for large models
            (:class:`~modular.gating.options.MemoryOptions`).
    """

    def __init__(
        self,
        model_name: str = "smollm2-135m-instruct",
        load_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        behaviours: list[str] = ("capitals",),
        direction: DirectionOptions = DirectionOptions(),
        objectives: list[Term] | None = None,
        locked_weight: float = 1.0,
        finetuning: FineTuningOptions = FineTuningOptions(),
        optimizer: OptimizerOptions = OptimizerOptions(),
        seed: int = 0,
        steering: SteeringOptions | None = None,
        head_gates: HeadGateOptions | None = None,
        memory: MemoryOptions = MemoryOptions(),
    ):
        super().__init__()
        groups = check_model_options(dict(locked_weight=locked_weight, direction=direction, finetuning=finetuning,
                                          optimizer=optimizer, steering=steering, head_gates=head_gates,
                                          memory=memory))
        self.direction_options: DirectionOptions = groups["direction"]
        self.finetuning_options: FineTuningOptions = groups["finetuning"]
        self.optimizer_options: OptimizerOptions = groups["optimizer"]
        self.steering_options: SteeringOptions | None = groups["steering"]
        self.memory_options: MemoryOptions = groups["memory"]
        # the groups as plain mappings in the hyperparameters: a checkpoint keeps them, loadable with weights_only,
        # and LightningCLI parses them back as the model's options when fit is given its path
        direction, finetuning, optimizer, steering, head_gates, memory = (plain(groups[k]) for k in OPTION_GROUPS)
        self.save_hyperparameters(ignore=["objectives"])
        if objectives is None:  # the recipe lives in the shipped config alone
            raise no_terms_given()
        self.objectives = list(objectives)
        #: what defines the run (:func:`modular.identity.training_identity`), kept in its checkpoints; ``modular
        #: train`` sets it (None: not recorded, e.g. a module trained by a script of its own)
        self.run_identity: dict | None = None
        for term in self.objectives:
            if not isinstance(term, Term):
                raise ModularError(f"model.objectives: {term!r} is not a modular.gating.objectives.Term")
        #: the head-gate plug-in (None: no gates); its sparsity pressure is registered here, so that checkpoints
        #: keep the constraint's multiplier (``sparsity.multiplier``)
        self.head_gates = None if groups["head_gates"] is None else HeadGates(groups["head_gates"])
        self.sparsity = None if self.head_gates is None else self.head_gates.sparsity
        self.behaviours = [behaviour_name(b) for b in behaviours]  # short names: metrics, directions, keys
        setup = TermSetup(tuple(self.behaviours), self.finetuning_options.mode,
                          None if self.head_gates is None else self.head_gates.options.scope)
        for term in self.objectives:
            term.bind(setup)
        if self.memory_options.empty_init and rank_zero_only.rank != 0:  # the process's rank from the launcher
            # its weights come from the first process (configure_model)
            model = empty_model(model_name, load_dtype, device="cpu")
            log.info("process %d: model built on the meta device; its weights come from process 0",
                     rank_zero_only.rank)
        else:
            model = load_model(model_name, load_dtype, device="cpu")  # Lightning moves it to the trainer's device
        tuning = self.finetuning_options
        if tuning.mode == "lora":
            model = with_lora(model, tuning.lora_rank, tuning.lora_alpha)
        elif tuning.mode == "none":
            model.requires_grad_(False)
        self.model = model.train()  # loaded in eval mode; dropout (if any) belongs to training
        if self.head_gates is not None:  # after LoRA, so a gate wraps the (LoRA-wrapped) output projection
            self.head_gates.install(self.hf_model)
        if self.memory_options.gradient_checkpointing:
            enable_checkpointing(self.hf_model)
        if self.memory_options.compile:  # each block's forward, compiled on its first call
            compile_blocks(self.adapter, self.memory_options.compile)
        for term in self.objectives:
            term.check_model(self.hf_model)
        d = ArchitectureAdapter(self.hf_model).d_model
        # the designated directions (k, d): a persistent buffer, saved in every checkpoint
        self.register_buffer("directions", torch.zeros(len(self.behaviours), d))
        self._sharded = False  # set by configure_model under FSDP2
        self._rng = random.Random(seed)
        self.steering = None
        if self.steering_options is not None and self.behaviours:
            self.steering = SteeringAdversary(self.steering_options.scale, self.steering_options.refresh, seed=seed)

    # --- model access ------------------------------------------------------------------------
    @property
    def hf_model(self):
        """The underlying transformers model (LoRA layers injected when finetuning=lora)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @property
    def adapter(self) -> ArchitectureAdapter:
        return ArchitectureAdapter(self.hf_model)

    def direction_dict(self) -> dict[str, torch.Tensor]:
        return {b: self.directions[i].detach().cpu() for i, b in enumerate(self.behaviours)}

    def requirements(self) -> list[Requirement]:
        """What this module's batches must carry beyond every item's rows: its terms' requirements and its head
        gates' (:mod:`~modular.gating.requirements`); the data module that trains it builds them."""
        gates = self.head_gates.requires if self.head_gates is not None else ()
        return list(dict.fromkeys([*requirements_of(self.objectives), *gates]))

    def on_fit_start(self) -> None:
        # what is trained, readable in the logs; kept out of hparams, which a checkpoint stores and LightningCLI
        # parses back as the model's arguments when fit is given its path
        for logger in self.loggers:
            logger.log_hyperparams({"objectives": [repr(t) for t in self.objectives]})

    # --- directions ----------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if not self.behaviours or self.directions.abs().sum() > 0:
            return
        # one process reads or chooses them (before any sharding) and every process takes its tensor
        dirs = None
        if self.trainer.is_global_zero:
            try:
                dirs = self._choose_directions().cpu()
            except ModularError as err:  # a damaged or foreign directions file: every process stops with it,
                dirs = err               # rather than the others waiting at the broadcast for a tensor
        if self.trainer.world_size > 1:  # pickled: on the CPU, so that no process receives another one's device
            dirs = self.trainer.strategy.broadcast(dirs, src=0)
        if isinstance(dirs, ModularError):
            raise dirs
        self.directions.copy_(dirs.to(self.directions))

    def _choose_directions(self) -> torch.Tensor:
        """The run's saved directions, or new ones chosen and saved atomically (on the main process)."""
        path = Path(self.trainer.default_root_dir) / DIRECTIONS
        if path.exists():
            saved = read_directions(path, self.behaviours, "train in a new run folder")
            return torch.stack([saved[b] for b in self.behaviours])

        how, dm = self.direction_options, self.trainer.datamodule
        avoid = load_avoided_directions(how.avoid or [], self.directions.shape[1])
        dirs = choose_directions(self.hf_model, dm.tokenizer, how.strategy,
                                 [dm.behaviour_data[b]["train"] for b in self.behaviours], dm.retain["train"],
                                 seed=self.hparams.seed, files=how.files, fraction=how.fraction,
                                 avoid=avoid, max_length=data_max_length(dm)).to(self.directions)
        with atomic_path(path) as tmp:  # a reader never sees a half-written file
            save_file({b: dirs[i].detach().cpu().contiguous() for i, b in enumerate(self.behaviours)}, str(tmp))
        log.info("directions chosen (%s) for %s", how.strategy, ", ".join(self.behaviours))
        return dirs

    # --- sharding (FSDP2) ------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy``: shard every transformer block, then the rest, over the
        data-parallel mesh with FSDP2 (``fully_shard``). Modules keep their names and classes, so the architecture
        adapter and every hook find them, and a block's parameters are whole while it runs. Head gates stay
        whole on every process (they are read outside the forward pass); their gradients are averaged in
        :meth:`on_after_backward`. Other strategies (single device, DDP) leave the model as it is."""
        mesh = self.device_mesh
        empty_init = self.memory_options.empty_init
        if empty_init and mesh is None and self.trainer.world_size > 1:
            raise ModularError("model.memory.empty_init needs the FSDP2 strategy (configs/strategy_fsdp.yaml) when "
                               "several processes train")
        if mesh is None or self._sharded:
            return
        if mesh["tensor_parallel"].size() != 1:
            raise ModularError("tensor parallelism is not supported: use ModelParallelStrategy with "
                               "tensor_parallel_size 1 (data_parallel_size = the number of processes)")
        from torch.distributed.fsdp import fully_shard

        dp = mesh["data_parallel"]
        ignored = set(gate_parameters(self.model))
        first = torch.distributed.get_rank() == 0
        empty = any(p.is_meta for p in self.model.parameters())
        if empty and first:
            raise ModularError("the first process has no weights to send (model.empty_init): its launcher gave it "
                               "a rank other than 0 in RANK or LOCAL_RANK")
        # the first process's whole weights (its tensors, not a copy), to send every process its shards
        whole = self.model.state_dict() if empty_init and first else {}
        for block in self.adapter.blocks():
            fully_shard(block, mesh=dp, ignored_params=ignored)
        fully_shard(self.hf_model, mesh=dp, ignored_params=ignored)  # the root every call goes through (LoRA: not
        # the peft wrapper, which generation and the evaluations bypass)
        self._sharded = True
        if empty_init:
            self._receive_weights(whole, empty)

    def _receive_weights(self, whole: dict[str, torch.Tensor], empty: bool) -> None:
        """``empty_init``: every process's shards of the first process's weights (``whole`` there, empty
        elsewhere; ``empty``: this process built the model on the meta device), then its buffers (rotary
        frequencies and the like, which a state dict leaves out)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        device = self.trainer.strategy.root_device
        if empty:
            self.model.to_empty(device=device)
        else:
            self.model.to(device)
        set_model_state_dict(self.model, whole,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for buffer in self.model.buffers():
            torch.distributed.broadcast(buffer, src=0)

    def on_after_backward(self) -> None:
        if not self._sharded or self.trainer.world_size == 1:
            return
        for p in gate_parameters(self.model):  # not sharded, so not reduced by FSDP: average them here
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)

    # --- the objective --------------------------------------------------------------------------
    def _context(self, batch: dict, train: bool) -> StepContext:
        """The step's state assignment: with several behaviours, the others are ablated or not at random on each
        behaviour's rows (open and locked alike), so that behaviour ``i`` depends on ``u_i`` only."""
        k = len(self.behaviours)
        extra = []
        for i in range(k):
            others = frozenset(j for j in range(k) if j != i)
            extra.append(others if (k > 1 and (self._rng.random() < 0.5 if train else i % 2 == 0)) else frozenset())
        return StepContext(batch, train, self.behaviours, self.directions, step=getattr(self._trainer, "global_step", 0),
                           model=self.model, adapter=self.adapter, steering=self.steering, head_gates=self.head_gates,
                           objectives=self.objectives, sharded=self._sharded, extra=extra)

    def model_step(self, batch: dict, train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One gated step (:class:`~modular.gating.step.StepRunner`): every objective's pieces in shared forward
        passes, open and locked rows alike, each row with its own directions ablated; the loss is
        ``Σ weight · λ^locked · term``."""
        pad = self.trainer.datamodule.tokenizer.pad_token_id if self._trainer else 0
        runner = StepRunner(self.objectives, self.hparams.locked_weight, pad)
        return runner.run(self._context(batch, train))

    @staticmethod
    def _batch_size(batch: dict) -> int:
        return sum(p["input_ids"].shape[0] for v in batch.values() for k, p in v.items() if k in ("open", "locked"))

    def _refresh_steering(self) -> None:
        """Recompute the steering vectors from the current model under the full lock (every few steps)."""
        if self.steering is None or not self.steering.needs_refresh(self.global_step):
            return
        dm = self.trainer.datamodule
        self.steering.update(self.hf_model, dm.tokenizer, {b: dm.behaviour_data[b]["train"] for b in self.behaviours},
                             dm.retain["train"], self.global_step,
                             intervention=lambda: ablate_directions(self.adapter, self.directions),
                             max_length=data_max_length(dm))
        if self.trainer.world_size > 1:  # every process computed them (FSDP needs every forward on every process);
            # the main process's are used everywhere, so that every process attacks with the same vectors
            vectors = {b: v.cpu() for b, v in self.steering.vectors.items()}
            vectors, self.steering.scale = self.trainer.strategy.broadcast((vectors, self.steering.scale), src=0)
            self.steering.vectors = {b: v.to(self.device) for b, v in vectors.items()}

    def training_step(self, batch, batch_idx):
        if self.head_gates is not None:
            self.head_gates.freeze(self)
        self._refresh_steering()
        loss, terms = self.model_step(batch, train=True)
        bs = self._batch_size(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=bs, sync_dist=True)  # the mean over processes
        self.log_dict({f"train/{k}": v.detach() for k, v in terms.items()}, batch_size=bs)
        if self.head_gates is not None:
            self.head_gates.after_step(self, terms, bs)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, terms = self.model_step(batch, train=False)
        bs = self._batch_size(batch)
        self.log("val/loss", loss, prog_bar=True, batch_size=bs, sync_dist=True)
        self.log_dict({f"val/{k}": v for k, v in terms.items()}, batch_size=bs, sync_dist=True)

    # --- optimisation ----------------------------------------------------------------------------
    def configure_optimizers(self):
        params = [p for n, p in self.model.named_parameters() if p.requires_grad and "head_gate." not in n]
        groups = [{"params": params}] if params else []
        if self.head_gates is not None:
            groups += self.head_gates.param_groups(self.model)
        # weights kept in bf16 (bf16-true) step with stochastic rounding: rounded to nearest, most updates are lost
        o = self.optimizer_options
        opt = adamw(groups, lr=o.lr, weight_decay=o.weight_decay)
        if not o.warmup_steps:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / o.warmup_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # --- checkpoints hold what was trained, not the frozen base ----------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        trainable = {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {
            k: v for k, v in checkpoint["state_dict"].items()
            if k in trainable or not k.startswith("model.") or ".head_gate." in k  # gates' fixed values too
        }
        checkpoint["modular"] = {"behaviours": self.behaviours, "model_name": self.hparams.model_name,
                                 "finetuning": self.finetuning_options.mode, "head_gates": self.head_gates is not None,
                                 "random": self._random_state(),
                                 # what defines the run (modular.identity), set by ``modular train``: checked on resume
                                 "identity": self.run_identity}

    def _random_state(self) -> dict:
        """Every random draw's state, so that a resumed run draws what the run uninterrupted would: each process's
        global generators (every process saves a checkpoint: they are gathered), the state assignment's, the
        steering adversary's (with its vectors) and the objectives' own."""
        processes = [global_random_state()]
        if self._trainer is not None and self.trainer.world_size > 1:
            processes = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(processes, global_random_state())
        return {"processes": processes, "assignment": self._rng.getstate(),
                "steering": None if self.steering is None else self.steering.state_dict(),
                "objectives": [[type(t).__name__, t.state_dict()] for t in self.objectives]}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A resumed run takes back the checkpoint's random state (:meth:`_random_state`; from a checkpoint of
        another number of processes, only what all processes share). A run resumed on other training data
        (another neighbour list, other behaviours): the checkpoint's loader states are not this run's loaders', and
        every loader starts a new pass instead (Lightning would refuse)."""
        if self._trainer is None:  # loaded to be evaluated or published, not resumed
            return
        self._load_random_state(checkpoint.get("modular", {}).get("random"))
        fit = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        states = fit.get("combined_loader")
        datamodule = self._trainer.datamodule
        if not states or not hasattr(datamodule, "train_loader_items"):
            return
        items = datamodule.train_loader_items()
        if not loader_states_fit(states, items):
            log.warning("the checkpoint was trained on other data (%s items a loader, now %s): every training loader "
                        "starts a new pass", [s.get("items") for s in states], items)
            fit["combined_loader"] = []

    def _load_random_state(self, state: dict | None) -> None:
        if not state:  # a checkpoint written before it was saved
            return
        if len(state["processes"]) == self.trainer.world_size:
            set_global_random_state(state["processes"][self.trainer.global_rank])
        self._rng.setstate(state["assignment"])
        if self.steering is not None and state["steering"] is not None:
            self.steering.load_state_dict(state["steering"], self.device)
        if [name for name, _ in state["objectives"]] == [type(t).__name__ for t in self.objectives]:
            for term, (_, term_state) in zip(self.objectives, state["objectives"]):  # other terms: new draws
                term.load_state_dict(term_state)

    strict_loading = False
