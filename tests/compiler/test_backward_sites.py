"""The backward's block ends (compiler.backward_sites) in one process (a fake process group, no ranks): the
sum of y's all-reduced gradient parts, RMSNorm's backward in any decomposition, + the residual stream's
gradient, fuse into one op; a region that computes something else stays unfused. The numerics, and the
backward graphs AOTAutograd makes of real clients in training: tests/compiler/test_clients.py."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from test_patterns_fast import HIDDEN, TOKENS, fake_group, post_grad_pass  # noqa: F401  (the fixture)
from torch import nn

from tpfuse.compiler import FusionPass

EPS = 1e-5
OP = torch.ops.tpfuse.allreduce_add_rmsnorm.default


class NormBackward(nn.Module):
    """What a backward graph holds at a block end: two column-parallel layers' input-gradient parts, each
    all-reduced, summed; RMSNorm's backward at ``a``, written as ``form`` says (or a look-alike); + g_h."""

    def __init__(self, form: str, hidden: int):
        super().__init__()
        self.form, self.hidden = form, hidden
        self.weight = nn.Parameter(torch.randn(hidden).bfloat16())

    def forward(self, p1, p2, a, g_h):
        group = dist.group.WORLD
        g = funcol.all_reduce(p1, "sum", group) + funcol.all_reduce(p2, "sum", group)
        af, gw = a.float(), g.float() * self.weight.float()
        if self.form == "weight in bf16":  # as Hugging Face's RMSNorm applies it, and so its backward
            gw = (g * self.weight).float()
        r = torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + EPS)
        if self.form == "autograd's":  # torch's decomposition: d/da of (a * r), chain rule by hand
            mean_term = (-0.5 * (gw * af).sum(-1, keepdim=True) * r.pow(3)).expand_as(af) / self.hidden
            d = gw * r + mean_term * (2 * af)
        elif self.form in ("factored", "weight in bf16"):  # the mean as a sum times 1 / H: a small float
            d = r * (gw - af * ((gw * af).sum(-1, keepdim=True) * (1.0 / self.hidden)) * r * r)
        elif self.form == "layer norm":  # LayerNorm's backward: not RMSNorm's
            c = af - af.mean(-1, keepdim=True)
            rc = torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + EPS)
            gc = gw - gw.mean(-1, keepdim=True)
            d = rc * (gc - c * (gw * c).mean(-1, keepdim=True) * rc * rc)
        else:  # "no mean term": the first of the two terms autograd may add one at a time
            d = r * gw
        weight_grad = (g.float() * af * r).sum((0, 1))  # reads g besides the norm's backward
        return g_h + d.to(a.dtype), weight_grad


def _graph(form: str, hidden: int = HIDDEN):
    torch.manual_seed(0)
    rows = [torch.randn(2, TOKENS // 2, hidden).bfloat16() for _ in range(4)]
    return post_grad_pass(NormBackward(form, hidden), *rows, fusion_pass=FusionPass(fusion_limit=16))


def test_rmsnorms_backward_in_any_form_fuses_with_the_parts_sum():
    for form, hidden in (("autograd's", HIDDEN), ("factored", HIDDEN), ("factored", 4096),
                         ("weight in bf16", 4096)):
        graph = _graph(form, hidden)
        ops = [n for n in graph.nodes if n.op == "call_function"]
        fused = [n for n in ops if n.target == OP]
        assert len(fused) == 1, (form, graph)
        assert fused[0].args[3] == EPS and {"norm_input", "grad_h"} <= set(fused[0].kwargs), fused[0]
        # one op where two all-reduces were; the weight's gradient reads the op's sum
        assert not [n for n in ops if "all_reduce" in str(n.target)], (form, graph)
        assert not [n for n in ops if n.target == torch.ops.aten.rsqrt.default and
                    any(u.target == torch.ops.aten.sub.Tensor for u in n.users)], graph


def test_a_region_that_is_not_rmsnorms_backward_stays_unfused():
    """Look-alikes that read the same tensors: LayerNorm's backward, and RMSNorm's backward less its mean
    term, at a small and a large hidden size (where random rows alone would tell them apart poorly)."""
    for form in ("no mean term", "layer norm"):
        for hidden in (HIDDEN, 4096):
            graph = _graph(form, hidden)
            assert not [n for n in graph.nodes if n.op == "call_function" and n.target == OP], (form, hidden)


class ShardedNormBackward(nn.Module):
    """Sequence parallel's backward block end: the parts summed on the rank, reduce-scattered, RMSNorm's
    backward at this rank's rows ``a`` + g_h; the result read by the residual stream and all-gathered."""

    def __init__(self, hidden: int, gathered: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden).bfloat16())
        self.gathered = gathered

    def forward(self, p1, p2, a, g_h):
        group = dist.group.WORLD
        g = funcol.reduce_scatter_tensor(p1 + p2, "sum", 0, group)
        af, gw = a.float(), g.float() * self.weight.float()
        r = torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + EPS)
        out = g_h + (r * (gw - af * (gw * af).mean(-1, keepdim=True) * r * r)).to(a.dtype)
        gathered = funcol.all_gather_tensor(out, 0, group) if self.gathered else out * 2
        return gathered, out * 3, (g.float() * af * r).sum((0, 1))


def test_sequence_parallels_backward_fuses_into_the_sharded_op():
    """At 12 rows of every rank's partial gradient (6 of this rank's): over the fusion limit of 4, which a
    sharded site does not need. Without the all-gather after it, the region stays unfused."""
    sharded = torch.ops.tpfuse.reduce_scatter_rmsnorm_backward_all_gather.default
    for gathered in (True, False):
        torch.manual_seed(0)
        rows = [torch.randn(2 * TOKENS, HIDDEN).bfloat16() for _ in range(2)]
        rows += [torch.randn(TOKENS, HIDDEN).bfloat16() for _ in range(2)]
        fusion_pass = FusionPass(fusion_limit=4)
        graph = post_grad_pass(ShardedNormBackward(HIDDEN, gathered), *rows, fusion_pass=fusion_pass)
        ops = [n.target for n in graph.nodes if n.op == "call_function"]
        [[site]] = fusion_pass.reports
        assert site.collective == "reduce-scatter"
        if gathered:
            assert site.fused and site.pattern == "ReduceScatterRMSNormBackwardAllGather", str(site)
            assert sharded in ops and not [t for t in ops if "_c10d_functional" in str(t)], ops
        else:
            assert not site.fused and sharded not in ops, str(site)
