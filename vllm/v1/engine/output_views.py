"""Read-only prefix views: cumulative outputs without an O(output length) copy per step.

The engine emits a cumulative RequestOutput for every running request at every step. Copying
the request's whole token list (and logprobs list) into each output made one decode step cost
O(B * L) host time for outputs of length L. The engine's lists only ever grow (append/extend),
so an output can instead hold a view of their first `n` items: it reads as a list of those n
items forever after, whatever the engine appends later. Finished outputs get real lists (one
copy per request over its whole life).

A view is a `collections.abc.Sequence`: len, indexing, slicing (a new list), iteration, `in`,
comparison with lists and `+` behave as for a list. It cannot be mutated; `list(view)` or
`view.tolist()` gives a list of one's own, and pickling / copying yields a plain list.
"""
from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence


class PrefixView(Sequence):
    """The first `n` items of an append-only list, read in place."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int):
        self._items = items
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        n = self._n
        if isinstance(index, slice):
            start, stop, step = index.indices(n)  # clipped to this view's n items
            if step > 0:  # start, stop >= 0 here
                return self._items[start:stop:step]
            # Reversed: indices() may say -1 ("before item 0"), which a slice of the longer
            # list would read as its last item.
            items = self._items
            return [items[i] for i in range(start, stop, step)]
        i = operator.index(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for an output of {n} items")
        return self._items[i]

    def __iter__(self):
        return itertools.islice(self._items, self._n)

    def __contains__(self, value) -> bool:
        return value in self.tolist()

    def tolist(self) -> list:
        """A list of one's own (O(n))."""
        items = self._items
        return items[:self._n] if len(items) != self._n else list(items)

    def __eq__(self, other):
        if isinstance(other, PrefixView):
            return self._n == other._n and self.tolist() == other.tolist()
        if isinstance(other, list):  # as list == list; a list never equals a tuple
            return self._n == len(other) and self.tolist() == other
        return NotImplemented

    __hash__ = None  # unhashable, as a list

    def __add__(self, other):
        if isinstance(other, PrefixView):
            other = other.tolist()
        if not isinstance(other, list):
            return NotImplemented
        return self.tolist() + other

    def __radd__(self, other):
        if not isinstance(other, list):
            return NotImplemented
        return other + self.tolist()

    def __repr__(self) -> str:
        return repr(self.tolist())

    def __reduce__(self):
        # pickle / copy / deepcopy give a plain list: the shared buffer stays private.
        return (list, (self.tolist(),))
