"""Symbolic sizes of graph values: ints, or sympy expressions of the graph's size symbols.

The backend reads token counts from dynamo's graph and the patterns from the post-grad graph, through
these same helpers, so both count a site's tokens alike.
"""

from __future__ import annotations

import torch


def static_int(size) -> int | None:
    """``size`` as an int when it is one, or a SymInt that dynamo specialised to a constant; else None."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return None


def size_expr(size):
    """An int, or the sympy expression of a SymInt (after the shape environment's replacements)."""
    as_int = static_int(size)
    if as_int is not None:
        return as_int
    expr = size.node.expr
    shape_env = getattr(size.node, "shape_env", None)
    return shape_env.replace(expr) if shape_env is not None and hasattr(shape_env, "replace") else expr


def token_count(shape) -> object:
    """Tokens of an activation ``[..., hidden]``: the product of all dims but the last (int or sympy)."""
    import sympy

    product = sympy.Integer(1) if any(static_int(s) is None for s in shape[:-1]) else 1
    for s in shape[:-1]:
        product = product * size_expr(s)
    if isinstance(product, int):
        return product
    product = sympy.expand(product)
    return int(product) if product.is_number else product


def describe_shape(shape) -> tuple:
    """A shape for reports and logs: ints, and symbolic sizes as their expressions' text (picklable)."""
    return tuple(static_int(s) if static_int(s) is not None else str(size_expr(s)) for s in shape)


def element_count(shape):
    """Elements of a tensor of ``shape``: the product of all its dims (int or sympy)."""
    return token_count(tuple(shape) + (1,))

