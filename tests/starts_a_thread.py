"""A user module that starts a thread as it is imported (tests of `posttrain.rl.user_code`: its
fork server must not fork after such an import)."""

from __future__ import annotations

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="started-at-import").start()


def echo(items, **_):
    return list(items)
