"""The lifecycle shell: the job state machine and the work that moves jobs through it.

The decision core (`orchestrator.core`) decides; this package does the I/O. Every tick of the daemon is one
`Reconciler.tick` (reconcile.py): level-triggered, it reads the attempts the database holds, steps each one, then
admits what the free slots allow. Nothing is held only in memory, so a restarted daemon carries on.

The states, each in one place:
    states.py        the job's states and their transitions
    machine.py       an attempt's states and transitions, and the one function that creates an attempt

A tick, and who does what in it:
    reconcile.py     Reconciler: steps each attempt (launch, look, bootstrap, watch, move market, stop, end)
    admission.py     Admission: which queued jobs start, where and on what (offers, spot policy, budget);
                     blocked and late jobs decided again
    budget_guard.py  BudgetGuard: the monthly cap, asked before a launch and of every live attempt
    local.py         LocalRunner: local attempts under the same supervisor and checkpoint contract
    cloud_steps.py   CloudSteps: a cloud attempt's runbook steps over SSH (bootstrap, push, start, pull)
    attempt_syncs.py AttemptSyncs: checkpoints, outputs and logs brought home, on threads beside the tick
    background_sync.py  the thread pool those syncs run on
    market_switch.py which market an attempt runs on: the decision, then the spot policy, asked every minute
    spot_probe.py    probing spot from on-demand where spot is seen only by launching (EC2)
    successor.py     make before break on a spot interruption notice
    handover.py      an instance launched ahead of time taking its job over
    schedule.py      whether a running attempt will end by its deadline, at the measured speed
    finish.py        what an ended attempt means for its job
    gone.py          an instance confirmed gone (by its provider, or the operator: `confirm-gone`), and what waited
    watch.py         Watch: how long the attempts were watched, what the timeouts that wait on an instance count

Beside the tick:
    orphans.py       instances no attempt drives: terminated and metered (the daemon's sweep, revert-local)
    revert.py        `burstctl revert-local`: the kill switch
    checkpoints.py   the local checkpoint store; homes.py where a job's runs and outputs are kept
    passenv.py       a job's pass_env, from the daemon's environment
    service.py       the wiring: a reconciler for the configured providers
"""
