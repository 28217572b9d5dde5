/work/main/target-old/release/deps/preload_core-ec8249231b9c0b3b.d: preload/core/src/lib.rs preload/core/src/config.rs preload/core/src/discovery.rs preload/core/src/errno.rs preload/core/src/fdtable.rs preload/core/src/guard.rs preload/core/src/hooks.rs preload/core/src/inventory.rs preload/core/src/listener_owner.rs preload/core/src/logging.rs preload/core/src/mirror/mod.rs preload/core/src/negative_cache.rs preload/core/src/ops/mod.rs preload/core/src/ops/around.rs preload/core/src/ops/call.rs preload/core/src/ops/data.rs preload/core/src/ops/fd.rs preload/core/src/ops/outcome.rs preload/core/src/ops/process.rs preload/core/src/ops/readiness.rs preload/core/src/ops/socket.rs preload/core/src/process.rs preload/core/src/real.rs preload/core/src/record.rs preload/core/src/registry.rs preload/core/src/runtime.rs preload/core/src/san/mod.rs preload/core/src/san/budget.rs preload/core/src/san/exchange.rs preload/core/src/san/kernel.rs preload/core/src/san/nudge.rs preload/core/src/san/outcome.rs preload/core/src/san/registrations.rs preload/core/src/san/stash.rs preload/core/src/san/tunables.rs preload/core/src/san/provider.rs preload/core/src/san/stashed.rs preload/core/src/san/verbs/mod.rs preload/core/src/san/verbs/connect.rs preload/core/src/san/verbs/link.rs preload/core/src/san/verbs/watcher.rs preload/core/src/san/link.rs preload/core/src/san/socket/mod.rs preload/core/src/san/socket/close.rs preload/core/src/san/socket/downgrade.rs preload/core/src/san/socket/drive.rs preload/core/src/san/socket/early.rs preload/core/src/san/socket/mirror.rs preload/core/src/san/socket/pending.rs preload/core/src/san/socket/stream.rs preload/core/src/san/socket/wait.rs preload/core/src/san/table.rs preload/core/src/san/service.rs preload/core/src/san/switchover.rs preload/core/src/san/wait.rs preload/core/src/san/downgrade.rs preload/core/src/san/readiness.rs preload/core/src/san/recv.rs preload/core/src/san/send.rs preload/core/src/settings.rs preload/core/src/stats.rs preload/core/src/track.rs

/work/main/target-old/release/deps/libpreload_core-ec8249231b9c0b3b.rlib: preload/core/src/lib.rs preload/core/src/config.rs preload/core/src/discovery.rs preload/core/src/errno.rs preload/core/src/fdtable.rs preload/core/src/guard.rs preload/core/src/hooks.rs preload/core/src/inventory.rs preload/core/src/listener_owner.rs preload/core/src/logging.rs preload/core/src/mirror/mod.rs preload/core/src/negative_cache.rs preload/core/src/ops/mod.rs preload/core/src/ops/around.rs preload/core/src/ops/call.rs preload/core/src/ops/data.rs preload/core/src/ops/fd.rs preload/core/src/ops/outcome.rs preload/core/src/ops/process.rs preload/core/src/ops/readiness.rs preload/core/src/ops/socket.rs preload/core/src/process.rs preload/core/src/real.rs preload/core/src/record.rs preload/core/src/registry.rs preload/core/src/runtime.rs preload/core/src/san/mod.rs preload/core/src/san/budget.rs preload/core/src/san/exchange.rs preload/core/src/san/kernel.rs preload/core/src/san/nudge.rs preload/core/src/san/outcome.rs preload/core/src/san/registrations.rs preload/core/src/san/stash.rs preload/core/src/san/tunables.rs preload/core/src/san/provider.rs preload/core/src/san/stashed.rs preload/core/src/san/verbs/mod.rs preload/core/src/san/verbs/connect.rs preload/core/src/san/verbs/link.rs preload/core/src/san/verbs/watcher.rs preload/core/src/san/link.rs preload/core/src/san/socket/mod.rs preload/core/src/san/socket/close.rs preload/core/src/san/socket/downgrade.rs preload/core/src/san/socket/drive.rs preload/core/src/san/socket/early.rs preload/core/src/san/socket/mirror.rs preload/core/src/san/socket/pending.rs preload/core/src/san/socket/stream.rs preload/core/src/san/socket/wait.rs preload/core/src/san/table.rs preload/core/src/san/service.rs preload/core/src/san/switchover.rs preload/core/src/san/wait.rs preload/core/src/san/downgrade.rs preload/core/src/san/readiness.rs preload/core/src/san/recv.rs preload/core/src/san/send.rs preload/core/src/settings.rs preload/core/src/stats.rs preload/core/src/track.rs

/work/main/target-old/release/deps/libpreload_core-ec8249231b9c0b3b.rmeta: preload/core/src/lib.rs preload/core/src/config.rs preload/core/src/discovery.rs preload/core/src/errno.rs preload/core/src/fdtable.rs preload/core/src/guard.rs preload/core/src/hooks.rs preload/core/src/inventory.rs preload/core/src/listener_owner.rs preload/core/src/logging.rs preload/core/src/mirror/mod.rs preload/core/src/negative_cache.rs preload/core/src/ops/mod.rs preload/core/src/ops/around.rs preload/core/src/ops/call.rs preload/core/src/ops/data.rs preload/core/src/ops/fd.rs preload/core/src/ops/outcome.rs preload/core/src/ops/process.rs preload/core/src/ops/readiness.rs preload/core/src/ops/socket.rs preload/core/src/process.rs preload/core/src/real.rs preload/core/src/record.rs preload/core/src/registry.rs preload/core/src/runtime.rs preload/core/src/san/mod.rs preload/core/src/san/budget.rs preload/core/src/san/exchange.rs preload/core/src/san/kernel.rs preload/core/src/san/nudge.rs preload/core/src/san/outcome.rs preload/core/src/san/registrations.rs preload/core/src/san/stash.rs preload/core/src/san/tunables.rs preload/core/src/san/provider.rs preload/core/src/san/stashed.rs preload/core/src/san/verbs/mod.rs preload/core/src/san/verbs/connect.rs preload/core/src/san/verbs/link.rs preload/core/src/san/verbs/watcher.rs preload/core/src/san/link.rs preload/core/src/san/socket/mod.rs preload/core/src/san/socket/close.rs preload/core/src/san/socket/downgrade.rs preload/core/src/san/socket/drive.rs preload/core/src/san/socket/early.rs preload/core/src/san/socket/mirror.rs preload/core/src/san/socket/pending.rs preload/core/src/san/socket/stream.rs preload/core/src/san/socket/wait.rs preload/core/src/san/table.rs preload/core/src/san/service.rs preload/core/src/san/switchover.rs preload/core/src/san/wait.rs preload/core/src/san/downgrade.rs preload/core/src/san/readiness.rs preload/core/src/san/recv.rs preload/core/src/san/send.rs preload/core/src/settings.rs preload/core/src/stats.rs preload/core/src/track.rs

preload/core/src/lib.rs:
preload/core/src/config.rs:
preload/core/src/discovery.rs:
preload/core/src/errno.rs:
preload/core/src/fdtable.rs:
preload/core/src/guard.rs:
preload/core/src/hooks.rs:
preload/core/src/inventory.rs:
preload/core/src/listener_owner.rs:
preload/core/src/logging.rs:
preload/core/src/mirror/mod.rs:
preload/core/src/negative_cache.rs:
preload/core/src/ops/mod.rs:
preload/core/src/ops/around.rs:
preload/core/src/ops/call.rs:
preload/core/src/ops/data.rs:
preload/core/src/ops/fd.rs:
preload/core/src/ops/outcome.rs:
preload/core/src/ops/process.rs:
preload/core/src/ops/readiness.rs:
preload/core/src/ops/socket.rs:
preload/core/src/process.rs:
preload/core/src/real.rs:
preload/core/src/record.rs:
preload/core/src/registry.rs:
preload/core/src/runtime.rs:
preload/core/src/san/mod.rs:
preload/core/src/san/budget.rs:
preload/core/src/san/exchange.rs:
preload/core/src/san/kernel.rs:
preload/core/src/san/nudge.rs:
preload/core/src/san/outcome.rs:
preload/core/src/san/registrations.rs:
preload/core/src/san/stash.rs:
preload/core/src/san/tunables.rs:
preload/core/src/san/provider.rs:
preload/core/src/san/stashed.rs:
preload/core/src/san/verbs/mod.rs:
preload/core/src/san/verbs/connect.rs:
preload/core/src/san/verbs/link.rs:
preload/core/src/san/verbs/watcher.rs:
preload/core/src/san/link.rs:
preload/core/src/san/socket/mod.rs:
preload/core/src/san/socket/close.rs:
preload/core/src/san/socket/downgrade.rs:
preload/core/src/san/socket/drive.rs:
preload/core/src/san/socket/early.rs:
preload/core/src/san/socket/mirror.rs:
preload/core/src/san/socket/pending.rs:
preload/core/src/san/socket/stream.rs:
preload/core/src/san/socket/wait.rs:
preload/core/src/san/table.rs:
preload/core/src/san/service.rs:
preload/core/src/san/switchover.rs:
preload/core/src/san/wait.rs:
preload/core/src/san/downgrade.rs:
preload/core/src/san/readiness.rs:
preload/core/src/san/recv.rs:
preload/core/src/san/send.rs:
preload/core/src/settings.rs:
preload/core/src/stats.rs:
preload/core/src/track.rs:
