# SPDX-License-Identifier: Apache-2.0
"""Errors of the fabric lab.

Each carries one line saying what happened and what to do; the command line prints it
as ``mooncake-te lab: <message>`` and exits nonzero.
"""
from __future__ import annotations

from mooncake_te.errors import ERR_CONTEXT, ERR_TRANSFER_TIMEOUT, MooncakeError


class LabError(MooncakeError, RuntimeError):
    """The lab could not do what was asked (root of the lab's errors)."""

    default_status = ERR_CONTEXT


class LabUnavailableError(LabError):
    """This host cannot run the lab: a missing package, no root, no kernel package.

    ``missing`` lists what is missing, each ``(what, how to get it)``.
    """

    def __init__(self, message: str = "", status=None, errno=None, missing=()):
        super().__init__(message, status=status, errno=errno)
        self.missing = tuple(missing)

    def __reduce__(self):
        return (_rebuild_unavailable, (self.message, self.status, self.errno, self.missing))


def _rebuild_unavailable(message, status, errno, missing):
    return LabUnavailableError(message, status=status, errno=errno, missing=missing)


class GuestError(LabError):
    """The guest failed: its kernel panicked, its setup failed, or qemu died."""


class GuestTimeoutError(GuestError, TimeoutError):
    """The guest ran past its timeout and was killed."""

    default_status = ERR_TRANSFER_TIMEOUT
