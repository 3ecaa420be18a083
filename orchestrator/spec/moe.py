"""`model.moe`: the mixture-of-experts section (fields in ``workers.model.config.MoEConfig``) and its checks.

Bounds (experts >= 2, every >= 1, capacity_factor > 0, a known router) are the fields' own and reported by
``messages.py``; the checks here relate fields to each other and to the model, each naming the fix.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import model_validator

from orchestrator.errors import SpecError
from orchestrator.spec.fields import STRICT, _divisors, _Section
from workers.model.config import ROUTER_TOP_K, MoEConfig

if TYPE_CHECKING:
    pass


class MoESpec(MoEConfig, _Section):
    """Mixture-of-experts feed-forwards (``workers.model.moe``)."""

    model_config = STRICT

    @model_validator(mode="after")
    def _check_routing(self) -> MoESpec:
        """top_k within the experts and agreeing with a router that fixes it; bias balancing on topk only."""
        fixed = ROUTER_TOP_K.get(self.router)
        if self.top_k is not None and self.router == "expert_choice":
            raise SpecError("model.moe.top_k", self.top_k, "is not read by router: expert_choice (each expert "
                            "picks its tokens; how many a token gets on average is capacity_factor)",
                            "remove model.moe.top_k and set model.moe.capacity_factor (e.g. 2)")
        if self.top_k is not None and fixed is not None and self.top_k != fixed:
            raise SpecError("model.moe.top_k", self.top_k, f"disagrees with router: {self.router}, whose paper "
                            f"routes each token to {fixed} expert(s)",
                            f"set model.moe.top_k: {fixed} or remove it, or use router: topk for another k")
        if self.top_k is not None and self.top_k > self.experts:
            raise SpecError("model.moe.top_k", self.top_k, f"is more than model.moe.experts={self.experts}: a token "
                            "cannot go to more experts than there are",
                            f"set top_k to at most {self.experts}, or raise model.moe.experts")
        if self.bias_update_rate != MoEConfig.model_fields["bias_update_rate"].default and not self.bias_balancing:
            raise SpecError("model.moe.bias_update_rate", self.bias_update_rate, "is the step of bias_balancing, "
                            "which is off", "set model.moe.bias_balancing: true (router: topk), or remove "
                            "model.moe.bias_update_rate")
        if self.balance_loss != "per_layer" and self.router != "topk":
            raise SpecError("model.moe.balance_loss", self.balance_loss, f"is router topk's balance loss, and "
                            f"router: {self.router} has its paper's", "set model.moe.router: topk, or remove "
                            "model.moe.balance_loss")
        if self.bias_balancing and self.router not in ("topk", "sigmoid"):
            raise SpecError("model.moe.bias_balancing", True, f"is DeepSeek-V3's balancing for router: topk or "
                            f"router: sigmoid, not {self.router}",
                            "set model.moe.router: sigmoid, or bias_balancing: false")
        self._check_groups()
        return self

    def _check_groups(self) -> None:
        """groups, top_groups and gate_scale are router sigmoid's; groups divide the experts, and the chosen groups
        hold at least top_k experts."""
        for name in ("groups", "top_groups", "gate_scale"):
            if getattr(self, name) != MoEConfig.model_fields[name].default and self.router != "sigmoid":
                raise SpecError(f"model.moe.{name}", getattr(self, name), f"is read by router: sigmoid only, not "
                                f"{self.router}", f"set model.moe.router: sigmoid, or remove model.moe.{name}")
        if self.experts % self.groups:
            raise SpecError("model.moe.groups", self.groups, f"does not divide model.moe.experts={self.experts}",
                            f"pick groups from {', '.join(map(str, _divisors(self.experts)))}")
        top = self.top_groups or self.groups
        if top > self.groups or top * (self.experts // self.groups) < self.k:
            raise SpecError("model.moe.top_groups", self.top_groups, f"must be at most groups={self.groups} and "
                            f"hold at least top_k={self.k} experts ({self.experts // self.groups} per group)",
                            "raise top_groups (or lower top_k)")

    @model_validator(mode="after")
    def _check_hierarchy(self) -> MoESpec:
        """router hierarchical: groups that split the experts evenly, and picks that fit in them."""
        groups = self.expert_groups
        if self.router != "hierarchical":
            unread = "expert_groups" if groups is not None else "group_top_k" if self.group_top_k != 1 else None
            if unread:
                raise SpecError(f"model.moe.{unread}", getattr(self, unread), f"is read by router: hierarchical "
                                f"only, not {self.router}", f"set model.moe.router: hierarchical, or remove {unread}")
            return self
        if groups is None or groups < 2 or self.experts % groups:
            raise SpecError("model.moe.expert_groups", groups, f"must be at least 2 and divide model.moe.experts="
                            f"{self.experts} (router: hierarchical splits the experts into equal groups)",
                            "set expert_groups to a divisor of experts, e.g. "
                            f"{next((d for d in range(2, self.experts) if self.experts % d == 0), 2)}")
        if self.group_top_k > groups:
            raise SpecError("model.moe.group_top_k", self.group_top_k, f"is more than expert_groups={groups}",
                            f"set group_top_k to at most {groups}")
        if self.k > self.experts // groups:
            raise SpecError("model.moe.top_k", self.k, f"is more than the {self.experts // groups} experts of a "
                            "group (router: hierarchical picks top_k inside each chosen group)",
                            f"set model.moe.top_k to at most {self.experts // groups}, or use fewer expert_groups")
        return self

    @model_validator(mode="after")
    def _check_token_limit(self) -> MoESpec:
        """The capped expert choice: expert_choice only, a limit that binds and can be met, its knobs with it."""
        b = self.max_experts_per_token
        knobs = [k for k in ("ec_entropy", "ec_iterations") if getattr(self, k) != MoEConfig.model_fields[k].default]
        if b is None:
            if knobs:
                raise SpecError(f"model.moe.{knobs[0]}", getattr(self, knobs[0]), "tunes the capped expert choice, "
                                "and model.moe.max_experts_per_token is unset", "set model.moe."
                                f"max_experts_per_token (router: expert_choice), or remove model.moe.{knobs[0]}")
            return self
        refused = [
            (self.router != "expert_choice", f"limits router: expert_choice, not {self.router}",
             "set model.moe.router: expert_choice, or remove max_experts_per_token (top_k limits token choice)"),
            (b >= self.experts, f"is not below model.moe.experts={self.experts}: it limits nothing",
             f"set it below {self.experts}, or remove it"),
            (b < self.capacity_factor, f"is below model.moe.capacity_factor={self.capacity_factor}: the experts "
             "take capacity_factor tokens' worth of slots per token on average, which b per token cannot hold",
             f"set it to at least {math.ceil(self.capacity_factor)}, or lower capacity_factor"),
        ]
        for applies, why, fix in refused:
            if applies:
                raise SpecError("model.moe.max_experts_per_token", b, why, fix)
        return self

    @model_validator(mode="after")
    def _check_norm_topk(self) -> MoESpec:
        """Only ``router: topk`` reads ``norm_topk``; the other routers' gates are their papers'."""
        if not self.norm_topk and self.router != "topk":
            raise SpecError("model.moe.norm_topk", False, f"is read by router: topk only, not {self.router}",
                            "set model.moe.router: topk, or remove model.moe.norm_topk")
        return self
