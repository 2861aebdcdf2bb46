"""The gated LightningModule: behaviours work in the open state and fail when their direction is ablated,
while retain data matches the frozen reference model in every state."""

from __future__ import annotations

import logging
import random
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from safetensors.torch import save_file

from modular import ModularError
from modular.data.formatting import IGNORE
from modular.files import atomic_path
from modular.gating.data import data_max_length
from modular.gating.loaders import loader_states_fit
from modular.gating.losses import response_margins
from modular.gating.objectives import HeadTaskTerm, Piece, StepContext, Term, build_objectives, default_objectives
from modular.gating.randomness import global_random_state, set_global_random_state
from modular.hooks import ablate_directions, ablate_rows, add_vectors, capture_head_inputs, enable_checkpointing
from modular.models.adapter import ArchitectureAdapter
from modular.models.attention import eager_attention
from modular.models.head_gates import deterministic_gate_values, head_gate_scope
from modular.models.precision import host_to_device
from modular.optim import adamw
from modular.runs import DIRECTIONS, read_directions

log = logging.getLogger("modular")


#: batch keys with one row per example and no sequence axis (nothing to pad)
PER_ROW = ("first_logp", "wrong_ids", "ref_hidden", "ref_hidden_blocks")


def concat_left_padded(batches: list[dict], pad_token_id: int) -> dict:
    """Concatenate left-padded batches along the batch axis, re-padding to the longest."""
    n = max(b["input_ids"].shape[1] for b in batches)
    out: dict[str, list] = {}
    fills = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE, "topk_ids": 0, "topk_logp": 0.0,
             "cf_input_ids": pad_token_id, "cf_attention_mask": 0}
    templates = {k: b[k] for b in batches for k in ("topk_ids", "topk_logp", *PER_ROW) if k in b}
    for b in batches:
        extra = n - b["input_ids"].shape[1]
        rows, width = b["input_ids"].shape
        for key, like in templates.items():  # pieces without reference tensors get empty ones
            if key == "wrong_ids" and key not in b:
                b = {**b, key: like.new_full((rows,), -1)}  # no competing answer
            elif key not in b:
                shape = (rows, *like.shape[1:]) if key in PER_ROW else (rows, width - 1, like.shape[-1])
                b = {**b, key: like.new_zeros(shape)}
        for key, t in b.items():
            if key in PER_ROW:
                pass  # one row per example, no sequence axis
            elif key in ("topk_ids", "topk_logp"):
                t = torch.nn.functional.pad(t, (0, 0, extra, 0), value=fills[key])
            else:
                t = torch.nn.functional.pad(t, (extra, 0), value=fills[key])
            out.setdefault(key, []).append(t)
    return {k: torch.cat(v) for k, v in out.items()}


def _rows(piece: Piece, merged: dict, row: int, n: int) -> Piece:
    """``piece`` with its own ``n`` rows, from ``row`` on, of the merged (re-padded) batch it ran in."""
    return Piece(**{**vars(piece), "batch": {key: v[row:row + n] for key, v in merged.items()}})


#: where head gates act: ``all`` inputs (closing a head removes it from the model) or the ``tasks`` only (a closed
#: head's input is swapped for its counterfactual one on task items; everything else runs the plain model)
GATE_SCOPES = ("all", "tasks")


#: numeric options of :class:`GatedLM` -> (lowest value, whether the lowest value itself is allowed)
_RANGES = {
    "lr": (0.0, False), "gate_lr": (0.0, False), "weight_decay": (0.0, True), "warmup_steps": (0, True),
    "locked_weight": (0.0, True), "lora_rank": (1, True), "lora_alpha": (0, False),
    "sparsity_weight": (0.0, True), "lm_loss_target": (0.0, True), "multiplier_lr": (0.0, False),
    "locked_steering": (0.0, True), "steering_refresh": (1, True),
    "gate_freeze_step": (0, True),
}


def check_model_options(options) -> None:
    """One line for the first numeric option out of range (before anything is loaded)."""
    for option, (low, inclusive) in _RANGES.items():
        value = options.get(option)
        if value is not None and (value < low if inclusive else value <= low):
            raise ModularError(f"model.{option} must be {'>=' if inclusive else '>'} {low:g}, got {value}")
    build_objectives(options.get("objectives"))  # a bad term option: one line, before anything loads
    if not 0.0 < options["direction_fraction"] <= 1.0:
        raise ModularError(f"model.direction_fraction must be in (0, 1], got {options['direction_fraction']}")
    if not 0.0 <= options["multiplier_ema"] < 1.0:
        raise ModularError(f"model.multiplier_ema must be in [0, 1), got {options['multiplier_ema']}")


class GatedLM(L.LightningModule):
    """Fine-tunes a causal LM so that each gated behaviour lives in its own residual direction,
    optionally with hard-concrete head gates under a sparsity pressure (sparse post-training).

    With ``head_gates`` every layer's attention output projection is wrapped in a
    :class:`~modular.models.head_gates.GatedOutputProjection` (registered parameters: the optimizer,
    FSDP and checkpoints see them). ``sparsity`` adds ``λ·E[L0]/N`` (``penalty``) or minimises it
    under the constraint ``lm_loss ≤ τ`` (``constraint``, GECO multiplier); ``lm_loss`` is the sum of
    the LM-keeping terms (retain KL to the reference and the LM-text KL). Sparse post-training
    needs no behaviour to lock: give ``behaviours: []`` and the DataModule's ``tasks``.

    Args:
        model_name: Model reference: built-in alias, .gguf file, local HF folder or hub id.
        load_dtype: Precision the base weights are loaded in (on the CPU; Lightning then moves them to the
            trainer's device): ``float32`` (default; for ``trainer.precision`` 32-true or bf16-mixed, which keep
            float32 master weights), ``bfloat16`` (for ``bf16-true``: half the host memory of a large model) or
            ``float16``.
        behaviours: Behaviours to gate (one direction each); must match the data's behaviours; may be empty. Built-in
            names, .jsonl files (named by their stem), hf:<dataset>, or NAME=<.jsonl file or hf:dataset>; the short
            name names the metrics, the direction and the key.
        direction_strategy: How to choose directions: low_variance, random, diff_in_means or file.
        direction_files: One direction file per behaviour (strategy ``file``): safetensors key ``direction``.
        direction_fraction: low_variance: sample inside this lowest fraction of principal components.
        avoid_directions: Run folders or directions files whose directions the chosen ones must be orthogonal
            to: a run gating another behaviour of the same base, so that the two runs merge and keep both locks.
        objectives: The terms of the loss (class paths, :mod:`modular.gating.objectives`): the open answers, the
            locked state, keeping the reference on retain, neighbour and raw text, the direction write term, the
            refusal guard, the tasks and the head-gate terms; each with its own weight and options. Default: the
            lock's terms at weight 1 (answers, locked refusal, retain KL, LM text, tasks).
        locked_weight: λ, the weight of every locked-state piece on top of its term's weight.
        finetuning: ``full``, ``lora`` or ``none`` (model frozen: only head gates train).
        lora_rank: LoRA rank (finetuning=lora).
        lora_alpha: LoRA alpha (finetuning=lora).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up steps.
        seed: Seed of direction choice and of state assignment.
        head_gates: Install hard-concrete gates on every attention head (on the output projection's input).
        gate_init: Initial log α of the gates (3.0: deterministic gate 1, model unchanged).
        gate_lr: AdamW learning rate of the gate parameters (no weight decay).
        sparsity: ``none``, ``penalty`` (λ·E[L0]/N added) or ``constraint`` (minimise λ·E[L0]/N s.t. lm_loss ≤ τ).
        sparsity_weight: λ, weight of the expected fraction of open heads E[L0]/N.
        lm_loss_target: τ of the constraint (sparsity: constraint).
        multiplier_lr: η of the multiplicative ascent on the Lagrange multiplier.
        multiplier_ema: Decay of the moving average of the constraint violation.
        multiplier_init: Initial Lagrange multiplier.
        locked_steering: Train the lock to hold under difference-in-means steering (the published weights'
            attack (b)): locked-state behaviour examples get a steering vector of the current model added at a
            random layer, scaled up to this multiple of the typical residual norm; 0 disables.
        steering_refresh: Steps between recomputing the steering vectors from the model being trained.
        gate_freeze_step: Prune, then fine-tune: from this step on every head gate is fixed at its
            deterministic value (closed heads stay closed, no gate noise) and the remaining steps train
            the weights of the pruned model only; ``null``: the gates learn to the end.
        gate_scope: Where the head gates act. ``all``: every input (a closed head is removed from the model,
            and folded out of the published weights). ``tasks``: task items only, where a closed gate swaps the
            head's input for its input on the item's counterfactual prompt; retain and LM text run the plain
            model, and the published model keeps every head: its tasks learn not to depend on the closed ones.
        gate_live_prob: ``gate_scope: tasks``, training: the chance that a closed head keeps its own input on one
            task item (drawn per item and head), so the tasks learn to ignore the head's content whether it is
            the item's own or the counterfactual one, instead of relying on it being counterfactual. The terms on
            the task items once the gates are fixed (consistency, margin, interchange, closed attribution) are
            objectives (:class:`~modular.gating.objectives.HeadTaskTerm`).
        gradient_checkpointing: Recompute each block in the backward pass instead of keeping its activations (less
            memory for larger models, about a third more compute). The lock's ablation and steering hooks act
            again on the recomputed blocks (:func:`~modular.hooks.replay_interventions`), so the gradients are the
            same; not available with head gates.
        empty_init: Under FSDP2 (``ModelParallelStrategy``): only the first process reads the weights; the others
            build the model on the meta device, and after sharding (:meth:`configure_model`) every process
            receives its shards of the first one's weights. Host memory for one copy of the model instead of one
            per process, for models that do not fit several times. Refused under other strategies with several
            processes. A single process reads the weights as without it.
    """

    def __init__(
        self,
        model_name: str = "smollm2-135m-instruct",
        load_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        behaviours: list[str] = ("capitals",),
        direction_strategy: str = "low_variance",
        direction_files: list[str] | None = None,
        direction_fraction: float = 0.25,
        avoid_directions: list[str] | None = None,
        objectives: list[Term] | None = None,
        locked_weight: float = 1.0,
        finetuning: str = "full",
        lora_rank: int = 16,
        lora_alpha: int = 32,
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        seed: int = 0,
        head_gates: bool = False,
        gate_init: float = 3.0,
        gate_lr: float = 0.05,
        sparsity: str = "none",
        sparsity_weight: float = 1.0,
        lm_loss_target: float | None = None,
        multiplier_lr: float = 0.1,
        multiplier_ema: float = 0.9,
        multiplier_init: float = 1.0,
        locked_steering: float = 0.0,
        steering_refresh: int = 20,
        gate_freeze_step: int | None = None,
        gate_scope: str = "all",
        gate_live_prob: float = 0.0,
        gradient_checkpointing: bool = False,
        empty_init: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["objectives"])
        from modular.heads.sparsity import make_sparsity
        from modular.models import empty_model, load_model

        check_model_options(self.hparams)
        self.objectives = list(default_objectives() if objectives is None else objectives)
        #: what defines the run (:func:`modular.identity.training_identity`), kept in its checkpoints; ``modular
        #: train`` sets it (None: not recorded, e.g. a module trained by a script of its own)
        self.run_identity: dict | None = None
        if finetuning not in ("full", "lora", "none"):
            raise ModularError(f"finetuning must be 'full', 'lora' or 'none', got '{finetuning}'")
        if finetuning == "none" and not head_gates:
            raise ModularError("finetuning 'none' trains nothing without head_gates: true")
        if sparsity != "none" and not head_gates:
            raise ModularError(f"sparsity '{sparsity}' needs head_gates: true")
        if gate_scope not in GATE_SCOPES:
            raise ModularError(f"gate_scope must be one of {', '.join(GATE_SCOPES)}, got '{gate_scope}'")
        if gate_scope == "tasks" and not head_gates:
            raise ModularError("gate_scope 'tasks' needs head_gates: true")
        if not 0.0 <= gate_live_prob < 1.0:
            raise ModularError(f"gate_live_prob must be in [0, 1), got {gate_live_prob}")
        for term in self.objectives:
            if not isinstance(term, Term):
                raise ModularError(f"model.objectives: {term!r} is not a modular.gating.objectives.Term")
        self.sparsity = make_sparsity(sparsity, sparsity_weight, lm_loss_target, multiplier_lr, multiplier_ema,
                                      multiplier_init)
        from modular.data import behaviour_name

        self.behaviours = [behaviour_name(b) for b in behaviours]  # short names: metrics, directions, keys
        for term in self.objectives:
            term.bind(self)
        if empty_init and rank_zero_only.rank != 0:  # the process's rank from the launcher's environment
            # its weights come from the first process (configure_model)
            model = empty_model(model_name, load_dtype, device="cpu")
            log.info("process %d: model built on the meta device; its weights come from process 0",
                     rank_zero_only.rank)
        else:
            model = load_model(model_name, load_dtype, device="cpu")  # Lightning moves it to the trainer's device
        if finetuning == "lora":
            from modular.models.lora import with_lora

            model = with_lora(model, lora_rank, lora_alpha)
        elif finetuning == "none":
            model.requires_grad_(False)
        self.model = model.train()  # loaded in eval mode; dropout (if any) belongs to training
        if head_gates:  # after LoRA, so a gate wraps the (LoRA-wrapped) output projection
            from modular.models.head_gates import install_head_gates

            install_head_gates(self.hf_model, init_log_alpha=gate_init)
        if gradient_checkpointing:
            if head_gates:  # the gates' scopes are module state, not hooks: a recomputed block would not see them
                raise ModularError("gradient_checkpointing is not available with head_gates")
            enable_checkpointing(self.hf_model)
        for term in self.objectives:
            term.check_model(self.hf_model)
        d = ArchitectureAdapter(self.hf_model).d_model
        # the designated directions (k, d): a persistent buffer, saved in every checkpoint
        self.register_buffer("directions", torch.zeros(len(self.behaviours), d))
        self._sharded = False  # set by configure_model under FSDP2
        self._rng = random.Random(seed)
        self.steering = None
        if locked_steering > 0 and self.behaviours:
            from modular.gating.steering import SteeringAdversary

            self.steering = SteeringAdversary(locked_steering, steering_refresh, seed=seed)

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
        from modular.directions import choose_directions, load_avoided_directions

        path = Path(self.trainer.default_root_dir) / DIRECTIONS
        if path.exists():
            saved = read_directions(path, self.behaviours, "train in a new run folder")
            return torch.stack([saved[b] for b in self.behaviours])

        hp, dm = self.hparams, self.trainer.datamodule
        avoid = load_avoided_directions(hp.avoid_directions or [], self.directions.shape[1])
        dirs = choose_directions(self.hf_model, dm.tokenizer, hp.direction_strategy,
                                 [dm.behaviour_data[b]["train"] for b in self.behaviours], dm.retain["train"],
                                 seed=hp.seed, files=hp.direction_files, fraction=hp.direction_fraction,
                                 avoid=avoid, max_length=data_max_length(dm)).to(self.directions)
        with atomic_path(path) as tmp:  # a reader never sees a half-written file
            save_file({b: dirs[i].detach().cpu().contiguous() for i, b in enumerate(self.behaviours)}, str(tmp))
        log.info("directions chosen (%s) for %s", hp.direction_strategy, ", ".join(self.behaviours))
        return dirs

    # --- sharding (FSDP2) ------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy``: shard every transformer block, then the rest, over the
        data-parallel mesh with FSDP2 (``fully_shard``). Modules keep their names and classes, so the architecture
        adapter and every hook find them, and a block's parameters are whole while it runs. Head gates stay
        whole on every process (they are read outside the forward pass); their gradients are averaged in
        :meth:`on_after_backward`. Other strategies (single device, DDP) leave the model as it is."""
        mesh = self.device_mesh
        if self.hparams.empty_init and mesh is None and self.trainer.world_size > 1:
            raise ModularError("model.empty_init needs the FSDP2 strategy (configs/strategy_fsdp.yaml) when "
                               "several processes train")
        if mesh is None or self._sharded:
            return
        if mesh["tensor_parallel"].size() != 1:
            raise ModularError("tensor parallelism is not supported: use ModelParallelStrategy with "
                               "tensor_parallel_size 1 (data_parallel_size = the number of processes)")
        from torch.distributed.fsdp import fully_shard

        dp = mesh["data_parallel"]
        ignored = set(self._gate_parameters())
        first = torch.distributed.get_rank() == 0
        empty = any(p.is_meta for p in self.model.parameters())
        if empty and first:
            raise ModularError("the first process has no weights to send (model.empty_init): its launcher gave it "
                               "a rank other than 0 in RANK or LOCAL_RANK")
        # the first process's whole weights (its tensors, not a copy), to send every process its shards
        whole = self.model.state_dict() if self.hparams.empty_init and first else {}
        for block in self.adapter.blocks():
            fully_shard(block, mesh=dp, ignored_params=ignored)
        fully_shard(self.hf_model, mesh=dp, ignored_params=ignored)  # the root every call goes through (LoRA: not
        # the peft wrapper, which generation and the evaluations bypass)
        self._sharded = True
        if self.hparams.empty_init:
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

    def _gate_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if p.requires_grad and "head_gate." in n]

    def on_after_backward(self) -> None:
        if not self._sharded or self.trainer.world_size == 1:
            return
        for p in self._gate_parameters():  # not sharded, so not reduced by FSDP: average them here
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
        return StepContext(self, batch, train, extra)

    def model_step(self, batch: dict, train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One gated step: every objective's pieces in one forward pass, open and locked rows alike, each row with
        its own directions ablated (:func:`~modular.hooks.ablate_rows`; long raw text in a forward of its own, so the
        short chat examples are not padded to its length); the loss is
        ``Σ weight · λ^locked · term``. With ``gate_scope: tasks`` the task pieces run apart, their closed heads
        fed the counterfactual run's inputs, and every other piece runs with the gates off."""
        hp = self.hparams
        pad = self.trainer.datamodule.tokenizer.pad_token_id if self._trainer else 0
        scoped = hp.gate_scope == "tasks"
        ctx = self._context(batch, train)
        pieces = [p for t in self.objectives for p in t.pieces(ctx) if p.batch["input_ids"].shape[0] > 0]
        names = [p.name for p in pieces]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ModularError(f"model.objectives: two terms compute {', '.join(twice)} (list each term once)")
        # one forward pass per kind of rows (chat pieces, raw text, head-gate task pieces): open and locked rows
        # share it, each row with its own directions ablated (task pieces keep one ablated set per pass)
        groups: dict[tuple[frozenset | None, bool, bool], list[Piece]] = {}
        for p in pieces:
            task_group = scoped and p.task
            groups.setdefault((p.ablated if task_group else None, p.raw_text, task_group), []).append(p)
        terms: dict[str, torch.Tensor] = ctx.losses  # readers see the losses computed before them
        weights: dict[str, float] = {}
        for (_, _, task_group), items in groups.items():
            merged = concat_left_padded([p.batch for p in items], pad)
            readers = [(t, p, name) for p in items for t in self.objectives if (name := t.reads(p))]
            with ExitStack() as stack:
                row_sets, every_row = self._row_ablations(items, merged["input_ids"].shape[0])
                if every_row:  # every row alike: the plain hooks
                    stack.enter_context(ablate_directions(self.adapter, row_sets[0][1]))
                elif row_sets:  # disjoint by construction: no check (it would wait for the device)
                    stack.enter_context(ablate_rows(self.adapter, row_sets, check=False))
                if task_group:
                    full = any(isinstance(t, HeadTaskTerm) and t.needs_cf_logits and t.active(ctx)
                               for t in self.objectives)
                    cf_inputs, cf_logits = self._counterfactual_run(merged, full_logits=full)
                    stack.enter_context(head_gate_scope(self.hf_model, replacements=cf_inputs,
                                                        live_prob=hp.gate_live_prob))
                elif scoped:
                    stack.enter_context(head_gate_scope(self.hf_model, active=False))
                vectors = self._row_vectors(items, merged["input_ids"].shape[0])
                if vectors:  # steered pieces get their vector on their own rows only, in the shared forward
                    stack.enter_context(add_vectors(self.adapter, vectors))
                out = self.model(input_ids=merged["input_ids"], attention_mask=merged["attention_mask"],
                                 output_hidden_states=bool(readers), use_cache=False)
                logits = out.logits
            # each piece's rows as one split of the outputs, not a slice each: a split's backward is one
            # concatenation, a slice's a zero tensor of the whole output per piece (vocabulary-wide for the logits)
            sizes = [p.batch["input_ids"].shape[0] for p in items]
            starts = [sum(sizes[:i]) for i in range(len(items))]
            piece_logits = logits.split(sizes)
            index = {id(p): i for i, p in enumerate(items)}
            for i, p in enumerate(items):
                sub = _rows(p, merged, starts[i], sizes[i])
                terms[p.name] = p.term.loss(ctx, sub, piece_logits[i])
                weights[p.name] = p.term.weight * (hp.locked_weight if p.locked else 1.0)
            piece_hidden = [h.split(sizes) for h in out.hidden_states] if readers else []
            for t, p, name in readers:
                i = index[id(p)]
                sub = _rows(p, merged, starts[i], sizes[i])
                terms[name] = t.loss_on(ctx, sub, piece_logits[i], tuple(h[i] for h in piece_hidden))
                weights[name] = t.weight * (hp.locked_weight if p.locked else 1.0)
            if task_group:
                plain_logits = []

                def plain(merged=merged, plain_logits=plain_logits):  # the plain run, once: every head its own input
                    if not plain_logits:
                        with head_gate_scope(self.hf_model, active=False):
                            plain_logits.append(self.model(input_ids=merged["input_ids"],
                                                           attention_mask=merged["attention_mask"],
                                                           use_cache=False).logits)
                    return plain_logits[0]

                group = {"merged": merged, "logits": logits, "cf_inputs": cf_inputs, "cf_logits": cf_logits,
                         "plain": plain}
                for t in self.objectives:
                    for name, value in t.group_terms(ctx, group).items():
                        terms[name], weights[name] = value, t.weight
        for t in self.objectives:
            for name, value in t.own_losses(ctx).items():
                terms[name], weights[name] = value, t.own_weight(name, hp.locked_weight)
        keeps_lm = {p.name for p in pieces if p.term.keeps_lm}
        total = torch.zeros((), device=self.device)
        lm_loss = torch.zeros((), device=self.device)
        for name, value in terms.items():
            total = total + weights[name] * value
            if name in keeps_lm:
                lm_loss = lm_loss + weights[name] * value
        if hp.head_gates:
            from modular.models.head_gates import expected_l0

            l0 = expected_l0(self.hf_model)
            terms["expected_l0"] = l0
            terms["lm_loss"] = lm_loss
            if self.sparsity is not None:
                n_heads = self.adapter.n_layers * self.adapter.n_heads
                total = self.sparsity(total, lm_loss, l0 / n_heads)
        return total, terms

    def _after_freeze(self, weight: float) -> bool:
        """A term applied once the gates are fixed runs: weighted, and the gates fixed (or never fixed)."""
        step = self.hparams.gate_freeze_step
        return bool(weight) and (step is None or self.global_step >= step)

    def _closed_attribution(self, merged: dict, cf_inputs: dict[int, torch.Tensor]) -> torch.Tensor:
        """Mean over the task rows of the closed heads' share of the summed |attribution-patching estimates| of
        every head's effect on the answer margin in the plain run (:class:`~modular.gating.objectives.ClosedAttribution`),
        differentiable in the weights."""
        closed = (deterministic_gate_values(self.hf_model) == 0).float()  # (layers, heads)
        # eager attention: SDPA kernels have no second derivative
        with eager_attention(self.hf_model), head_gate_scope(self.hf_model, active=False), \
                capture_head_inputs(self.adapter, detach=False) as z:
            logits = self.model(input_ids=merged["input_ids"], attention_mask=merged["attention_mask"],
                                use_cache=False).logits
        margins, keep = response_margins(logits, merged["labels"], merged["wrong_ids"])
        keep = keep & (merged["cf_input_ids"] != merged["input_ids"]).any(dim=1)  # a counterfactual of its own
        layers = sorted(z)
        if not keep.any() or not closed.any():
            return logits.sum() * 0.0
        grads = torch.autograd.grad(margins[keep].sum(), [z[i] for i in layers], create_graph=True)
        estimates = torch.stack([(g * (cf_inputs[i].to(g) - z[i])).sum(dim=(1, 3)) for i, g in zip(layers, grads)],
                                dim=1).abs().float()  # (batch, layers, heads): summed over positions and dims
        share = (estimates * closed).sum(dim=(1, 2)) / estimates.sum(dim=(1, 2)).clamp(min=1e-6)
        return share[keep].mean()

    @torch.no_grad()
    def _counterfactual_run(self, merged: dict, full_logits: bool) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The plain model on the task items' counterfactual prompts: every head's input (what a closed gate
        lets in), and the logits (every position with ``full_logits``, else the last one only)."""
        from modular.heads.ranking import last_position_logits

        inputs = {"input_ids": merged["cf_input_ids"], "attention_mask": merged["cf_attention_mask"]}
        with head_gate_scope(self.hf_model, active=False), capture_head_inputs(self.adapter) as z:
            logits = self.model(**inputs, use_cache=False).logits if full_logits else last_position_logits(self.model, inputs)
        return dict(z), logits

    def _row_ablations(self, items: list[Piece], n_rows: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
        """``(rows, directions)`` for every ablated set among the pieces (a (n_rows,) mask of their rows), and whether
        one set covers every row. Built on the host from the pieces' sizes and sent in one asynchronous copy: nothing
        here waits for the device."""
        sets: dict[frozenset, list[tuple[int, int]]] = {}
        row = 0
        for piece in items:
            n = piece.batch["input_ids"].shape[0]
            if piece.ablated:
                sets.setdefault(piece.ablated, []).append((row, row + n))
            row += n
        if not sets:
            return [], False
        masks = torch.zeros(len(sets), n_rows, dtype=torch.bool)
        for j, spans in enumerate(sets.values()):
            for start, end in spans:
                masks[j, start:end] = True
        every_row = len(sets) == 1 and sum(end - start for start, end in next(iter(sets.values()))) == n_rows
        masks = host_to_device(masks, self.directions.device)
        return [(masks[j], self._directions_of(ablated)) for j, ablated in enumerate(sets)], every_row

    def _directions_of(self, ablated: frozenset) -> torch.Tensor:
        """The rows of ``directions`` of the behaviours in ``ablated``: a slice where they are consecutive (no index
        tensor to copy to the device)."""
        idx = sorted(ablated)
        if idx == list(range(idx[0], idx[-1] + 1)):
            return self.directions[idx[0]:idx[-1] + 1]
        return self.directions.index_select(0, host_to_device(torch.tensor(idx), self.directions.device))

    def _row_vectors(self, items: list[Piece], n_rows: int) -> dict[int, torch.Tensor]:
        """{block: (n_rows, d) vectors}: each steered piece's vector on its rows, zeros elsewhere."""
        vectors: dict[int, torch.Tensor] = {}
        row = 0
        for piece in items:
            n = piece.batch["input_ids"].shape[0]
            if piece.steer is not None:
                block, vector = piece.steer
                rows = vectors.setdefault(block, torch.zeros(n_rows, vector.shape[-1], device=self.device))
                rows[row:row + n] += vector.to(rows)
            row += n
        return vectors

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

    def _freeze_gates(self) -> None:
        """At ``gate_freeze_step``: fix every gate at its deterministic value (kept in checkpoints as ``fixed``)."""
        step = self.hparams.gate_freeze_step
        if step is None or self.global_step < step:
            return
        from modular.models.head_gates import head_gate_modules, open_heads

        gates = [g for g in head_gate_modules(self.hf_model) if torch.isnan(g.fixed).any()]
        for g in gates:  # log α then gets zero gradients (kept trainable: DDP expects the same parameters)
            g.fixed.copy_(g.deterministic())
        if gates:
            log.info("step %d: head gates fixed (%d heads open); the weights go on training", self.global_step,
                     open_heads(self.hf_model))

    def training_step(self, batch, batch_idx):
        self._freeze_gates()
        self._refresh_steering()
        loss, terms = self.model_step(batch, train=True)
        bs = self._batch_size(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=bs, sync_dist=True)  # the mean over processes
        self.log_dict({f"train/{k}": v.detach() for k, v in terms.items()}, batch_size=bs)
        if self.hparams.head_gates:
            from modular.models.head_gates import open_heads

            self.log("train/open_heads", float(open_heads(self.hf_model)), prog_bar=True, batch_size=bs)
        if self.sparsity is not None:
            lm_loss = terms["lm_loss"].detach()
            if self._trainer is not None and self.trainer.world_size > 1:  # one μ on every process
                lm_loss = self.trainer.strategy.reduce(lm_loss, reduce_op="mean")
            self.sparsity.update(lm_loss.item())  # μ for the next step
            self.log_dict({f"train/{k}": v for k, v in self.sparsity.metrics().items()}, batch_size=bs)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, terms = self.model_step(batch, train=False)
        bs = self._batch_size(batch)
        self.log("val/loss", loss, prog_bar=True, batch_size=bs, sync_dist=True)
        self.log_dict({f"val/{k}": v for k, v in terms.items()}, batch_size=bs, sync_dist=True)

    # --- optimisation ----------------------------------------------------------------------------
    def configure_optimizers(self):
        gates = [p for n, p in self.model.named_parameters() if p.requires_grad and "head_gate." in n]
        params = [p for n, p in self.model.named_parameters() if p.requires_grad and "head_gate." not in n]
        groups = [{"params": params}] if params else []
        if gates:
            groups.append({"params": gates, "lr": self.hparams.gate_lr, "weight_decay": 0.0})
        # weights kept in bf16 (bf16-true) step with stochastic rounding: rounded to nearest, most updates are lost
        opt = adamw(groups, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        if not self.hparams.warmup_steps:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.hparams.warmup_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # --- checkpoints hold what was trained, not the frozen base ----------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        trainable = {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {
            k: v for k, v in checkpoint["state_dict"].items()
            if k in trainable or not k.startswith("model.") or ".head_gate." in k  # gates' fixed values too
        }
        checkpoint["modular"] = {"behaviours": self.behaviours, "model_name": self.hparams.model_name,
                                 "finetuning": self.hparams.finetuning, "head_gates": self.hparams.head_gates,
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
