/*
 * relay.pml: a checked model of the outbox-relay protocol (issue 9).
 *
 * What it is: the rows of one outbox table, the claimer, the broker channel
 * of delivery tasks, the delivery workers (with their lease keeper), the
 * rescuer and an abstract clock, as concurrent Promela processes. Every step
 * that touches a row is one atomic step, because in PostgreSQL it is one
 * statement (one UPDATE, under row locks, SKIP LOCKED). Each step names, in
 * a comment, the statement of outbox_relay/sql/queries.sql (`-- name:`) or
 * the Python function it stands for. docs/model.md explains the
 * abstractions and how to run it (model/check.sh).
 *
 * Compile-time switches (spin -DNAME ...):
 *   FREEZE_BUG       the historical claim: rescue only inside the claim, and
 *                    the claim skipped when rows in 'processing' (live or
 *                    expired) reach the cap. The liveness check must fail.
 *   STRICT_ATTEMPTS  assert attempts <= MAX_ATTEMPTS with no allowance for
 *                    duplicated delivery tasks (it failed when DUP > 0 until
 *                    begin counted once per lease version: docs/model.md).
 *   EXCLUSIVE        assert that no two workers ever hold a live lease on one
 *                    row at once (fails when DUP > 0: duplicates by design).
 *   NO_STEAL         assert that a release of an unpublished row (begin's
 *                    "too little lease left", a failed fan-out) never ends
 *                    the lease of a worker that began under the same version
 *                    and is publishing (passes since the release leaves a
 *                    begun row alone; with RELEASE_BEGUN it fails).
 *   RELEASE_BEGUN    the release without its began_version guard.
 *   WEAK_FENCE       the fenced statements without their lease test
 *                    (`lease_until IS NOT NULL` / `>= now()`): a stale write
 *                    gets through, and the safety check must fail.
 *   NO_VERSION_FENCE the fenced statements without their version test
 *                    (`lease_version = %(version)s`): a worker of an older
 *                    lease writes into a newer one; the safety check must fail.
 *   HOLD_ALWAYS      a claim that leaves rows for following runs whatever
 *                    their task's queue (frag_held without its count): the
 *                    liveness check must fail.
 *   NOMONITOR        leave out the invariant monitor (the liveness runs).
 *   NROWS NW MAX_ATTEMPTS CAP HOLD_QUEUE K LOSS DUP CRASH LATE FANFAIL FAULTS
 *                    sizes and fault budgets, below.
 */

/* ------------------------------------------------------------------ sizes */
#ifndef NROWS
#define NROWS 2          /* outbox rows (1..3) */
#endif
#ifndef NW
#define NW 2             /* delivery workers (2..3) */
#endif
#ifndef MAX_ATTEMPTS
#define MAX_ATTEMPTS 2   /* OUTBOX_MAX_ATTEMPTS / RetryPolicy.max_attempts */
#endif
#ifndef CAP
#define CAP 1            /* OUTBOX_MAX_IN_FLIGHT */
#endif
#ifndef HOLD_QUEUE
#define HOLD_QUEUE 1     /* the claim's follow_queue (frag_held); NROWS: no hold */
#endif
#ifndef K
#define K 4              /* broker capacity in tasks, 4..6 (never reached: asserted) */
#endif
/* Fault budgets. Bounded so that liveness can hold: a broker that loses
 * every task forever, or workers that crash forever, deliver nothing. */
#ifndef LOSS
#define LOSS 1           /* delivery tasks the broker loses (or expires unrun) */
#endif
#ifndef DUP
#define DUP 1            /* delivery tasks the broker delivers twice */
#endif
#ifndef CRASH
#define CRASH 1          /* worker crashes, at any step of a delivery */
#endif
#ifndef LATE
#define LATE 1           /* times time passes over a lease whose delivery is
                            still under way (slow broker, slow or hung worker) */
#endif
#ifndef FANFAIL
#define FANFAIL 1        /* fan-outs that fail halfway (fanout.fan_out except) */
#endif
#ifndef FAULTS
#define FAULTS 2         /* faults of any kind in one run, at most */
#endif

/* ---------------------------------------------------------------- the rows */
/* status */
#define ABSENT  0        /* not inserted yet */
#define PENDING 1
#define PROC    2        /* 'processing': lease_until IS NOT NULL (the CHECK) */
#define DONE    3
#define DEAD    4

/* lease_until relative to now(), meaningful only while status = PROC.
 * FULL: at least a whole delivery's worst case is left (begin's %(needed)s);
 * SHORT: live (lease_until >= now()) but less than that; EXPIRED: < now(). */
#define EXPIRED 0
#define SHORT   1
#define FULL    2

byte st[NROWS];          /* status */
byte att[NROWS];         /* attempts */
byte ver[NROWS];         /* lease_version, the fencing token (only grows) */
byte lease[NROWS];       /* lease_until, abstracted as above */

/* The receiver: whether each row was published (at least once). */
bit pub[NROWS];

/* Ghosts (never read by the protocol, only by assertions). */
bit ended[NROWS];        /* the current lease version's lease was ended (a
                            finalize, release or rescue) */
bit begun[NROWS];        /* a delivery began under the current lease version */
byte dupb[NROWS];        /* begins under a version that had already begun */

/* ------------------------------------------------- the broker (a multiset) */
/* A task is (id, lease_version), encoded id*16 + version (version >= 1, so
 * 0 is an empty slot). Kept sorted, nonempty slots first: the broker is a bag
 * and workers take ANY task, so order is free (reordering and late delivery
 * come from that); sorting makes equal bags one state. */
#define TASK(r, v) ((r) * 16 + (v))
byte bag[K];
byte bagn;               /* nonempty slots */

/* -------------------------------------------------------- the workers */
#define W_IDLE       0
#define W_NOTSTARTED 1   /* begin found too little lease left: give it back */
#define W_BEGUN      2   /* begin started it (attempt counted); publishing */
#define W_PUBLISHED  3   /* the publish returned; finalize next */

#define O_OK     1       /* publisher returned normally            -> done     */
#define O_RETRY  2       /* RetryableError / unexpected exception  -> pending
                                                           (dead on the last) */
#define O_NOTPUB 3       /* not published (hold.alive() false)     -> pending,
                                                        attempt refunded */

byte wst[NW];            /* worker state */
byte wr[NW];             /* the task's row id */
byte wv[NW];             /* the task's lease_version */
byte watt[NW];           /* attempts as begin RETURNed them (classify reads it) */
byte wout[NW];           /* publish outcome */

/* The claimer's rows to give back after a failed fan-out (0: none). */
byte relv[NROWS];

/* Fault budgets left. */
byte loss = LOSS, dup = DUP, crash = CRASH, late = LATE, fanfail = FANFAIL;
byte faults = FAULTS;
#define CAN(k) (k > 0 && faults > 0)
#define SPEND(k) k--; faults--

/* ------------------------------------------------------------- helpers */
#define FIN(r) (st[r] == DONE || st[r] == DEAD)
#if NROWS == 1
#define ALL_FINISHED (FIN(0))
#elif NROWS == 2
#define ALL_FINISHED (FIN(0) && FIN(1))
#else
#define ALL_FINISHED (FIN(0) && FIN(1) && FIN(2))
#endif

#if NROWS == 1
#define ANY_RELV (relv[0] != 0)
#define ANY_CLAIMED (claimed[0])
#elif NROWS == 2
#define ANY_RELV (relv[0] != 0 || relv[1] != 0)
#define ANY_CLAIMED (claimed[0] || claimed[1])
#else
#define ANY_RELV (relv[0] != 0 || relv[1] != 0 || relv[2] != 0)
#define ANY_CLAIMED (claimed[0] || claimed[1] || claimed[2])
#endif

/* Every status change goes through here: a row that is done stays done
 * (no operator actions are modelled, so nothing may leave 'done'). */
inline set_status(r, s) {
  assert(st[r] != DONE);
  st[r] = s
}

inline check_attempts(r) {
#ifdef STRICT_ATTEMPTS
  assert(att[r] <= MAX_ATTEMPTS)
#else
  /* attempts exceed the limit only by begins of an already begun lease
   * version, i.e. by duplicated delivery tasks (docs/model.md) */
  assert(att[r] <= MAX_ATTEMPTS + dupb[r])
#endif
}

/* The fence of `begin_one`, `finalize_one`/`finalize`:
 *   WHERE id = %(id)s AND lease_version = %(version)s AND lease_until IS NOT NULL
 * and of `extend_lease` (a live lease: lease_until >= now()). */
#if defined(WEAK_FENCE)
#define FENCE(r, v) (ver[r] == v)
#define RENEW_FENCE(r, v) (ver[r] == v)
#elif defined(NO_VERSION_FENCE)
#define FENCE(r, v) (st[r] == PROC)
#define RENEW_FENCE(r, v) (st[r] == PROC && lease[r] != EXPIRED)
#else
#define FENCE(r, v) (ver[r] == v && st[r] == PROC)
#define RENEW_FENCE(r, v) (ver[r] == v && st[r] == PROC && lease[r] != EXPIRED)
#endif

/* No stale write: a fenced write that gets through comes from the holder
 * of the current lease (the writer's version v is the row's), which nobody
 * has ended since it was granted. */
#define NOT_STALE(r, v) assert(v == ver[r] && !ended[r])

/* queries.sql `finalize_one` (and `finalize`, fanout.release,
 * store.mark_done/reschedule/mark_dead): the fenced finalize. A write under
 * an old version, or after the lease was ended, changes nothing ("my lease
 * was lost"). */
inline finalize_one(r, v, s, refund) {
  if
  :: FENCE(r, v) ->
       NOT_STALE(r, v);
       ended[r] = 1;
       set_status(r, s);
       if
       :: refund && att[r] > 0 -> att[r]--      /* greatest(0, attempts - refund) */
       :: else -> skip
       fi;
       lease[r] = EXPIRED                       /* lease_until = NULL */
  :: else -> skip                               /* stale: zero rows */
  fi
}

/* A release (unpublished, nothing refunded) of row r under version v, by
 * worker `me` (NW: the claimer): fan-out's failure path and a task whose
 * begin found too little lease. queries.sql `finalize`/`finalize_one` with
 * unless_begun: a row that some delivery began under the current version
 * (began_version = lease_version) is left to that delivery. With NO_STEAL,
 * assert that a release that does go through never ends the lease of
 * another worker that began under v and is still publishing.
 * RELEASE_BEGUN: the release without that guard, as it was (NO_STEAL fails). */
#ifdef RELEASE_BEGUN
#define RELEASE_LEFT(r) (0)
#else
#define RELEASE_LEFT(r) (begun[r])
#endif
inline release(r, v, me, i) {
  if
  :: FENCE(r, v) && RELEASE_LEFT(r) -> skip
  :: else ->
#ifdef NO_STEAL
       if
       :: FENCE(r, v) ->
            for (i : 0 .. NW - 1) {
              assert(i == me || !(wr[i] == r && wv[i] == v &&
                                  (wst[i] == W_BEGUN || wst[i] == W_PUBLISHED)))
            };
            i = 0
       :: else -> skip
       fi;
#endif
       finalize_one(r, v, PENDING, 0)
  fi
}

/* queries.sql `rescue`: every expired lease goes back to pending, or to dead
 * when its last attempt began (attempts >= max_attempts). Unfenced by
 * version: it takes only leases that already expired by the database clock. */
inline rescue_all(r) {
  for (r : 0 .. NROWS - 1) {
    if
    :: st[r] == PROC && lease[r] == EXPIRED ->
         ended[r] = 1;
         if
         :: att[r] >= MAX_ATTEMPTS -> set_status(r, DEAD)
         :: else -> set_status(r, PENDING)
         fi
    :: else -> skip
    fi
  };
  r = 0
}

inline bag_sort(i, j, t) {
  for (i : 0 .. K - 2) {
    for (j : 0 .. K - 2 - i) {
      if
      :: bag[j] < bag[j + 1] -> t = bag[j]; bag[j] = bag[j + 1]; bag[j + 1] = t
      :: else -> skip
      fi
    }
  };
  i = 0; j = 0; t = 0
}

/* Celery apply_async of deliver(id, lease_version): into the broker. */
inline send_task(r, i, j, t) {
  assert(bagn < K);        /* K is large enough for every run checked */
  bag[bagn] = TASK(r, ver[r]);
  bagn++;
  bag_sort(i, j, t)
}

/* Does row r's current lease still have a delivery under way: its task in
 * the broker, a (not crashed) worker working on it, or the claimer about to
 * give it back? Time passing over such a lease is a fault (LATE); over any
 * other lease it is free. This is the fairness assumption that makes
 * liveness provable: deliveries are not always slower than the lease. */
#define SLOT(i, r) (bag[i] == TASK(r, ver[r]))
#if K == 4
#define IN_BAG(r) (SLOT(0, r) || SLOT(1, r) || SLOT(2, r) || SLOT(3, r))
#elif K == 5
#define IN_BAG(r) (SLOT(0, r) || SLOT(1, r) || SLOT(2, r) || SLOT(3, r) || SLOT(4, r))
#elif K == 6
#define IN_BAG(r) (SLOT(0, r) || SLOT(1, r) || SLOT(2, r) || SLOT(3, r) || SLOT(4, r) || \
                   SLOT(5, r))
#else
#error "K must be 4, 5 or 6"
#endif
#define AT_WORKER(w, r) (wst[w] != W_IDLE && wr[w] == r && wv[w] == ver[r])
#if NW == 2
#define AT_A_WORKER(r) (AT_WORKER(0, r) || AT_WORKER(1, r))
#else
#define AT_A_WORKER(r) (AT_WORKER(0, r) || AT_WORKER(1, r) || AT_WORKER(2, r))
#endif
#define PROSPECT(r) ((relv[r] != 0 && relv[r] == ver[r]) || IN_BAG(r) || AT_A_WORKER(r))
#define LIVE(r) (st[r] == PROC && lease[r] != EXPIRED)

/* ---------------------------------------------------------------- producer */
/* producer.enqueue -> queries.sql `insert`: a new pending row, due now
 * (the caller's transaction commits it; rows appear one by one). */
active proctype producer() {
  byte r;
  for (r : 0 .. NROWS - 1) {
    atomic { st[r] = PENDING }
  };
  r = 0
}

/* ----------------------------------------------------------------- claimer */
/* tasks.claim -> Claimer.run_once -> store.claim(rescue_first=False,
 * count_attempt=False) -> queries.sql `claim` (under `advisory_lock`), then
 * fanout.fan_out. One claim at a time: concurrent claims are serialized by
 * the advisory lock and SKIP LOCKED, so an atomic claim stands for them.
 * It runs on beat's tick forever, so it is always enabled (a no-op when
 * nothing is due or there is no room). */
active proctype claimer() {
  byte r, n, room, live, off, i, j, t, queued;
  bit claimed[NROWS];
  bit aged;
  do
  :: atomic {
       !ANY_RELV ->
       /* ORDER BY available_at, id ... FOR UPDATE SKIP LOCKED: any due row
        * may come first (back-off and locks reorder rows): the scan starts
        * at any row. */
       select (off : 0 .. NROWS - 1);
       /* frag_held: every row stands for a following durable task's row; a
        * claim leaves it while HOLD_QUEUE leased rows are not yet begun
        * (their tasks queued), unless it has waited the hold out: either,
        * whenever (the hold's clock is not modelled). */
       select (aged : 0 .. 1);
       t = 0;    /* a plain step: Spin allows no jump into a d_step */
       d_step {
         queued = 0;
         for (r : 0 .. NROWS - 1) { queued = queued + (LIVE(r) && !begun[r]) };
         live = 0;
#ifdef FREEZE_BUG
         /* The old claim: its in-flight count took every 'processing' row,
          * expired or not, and at the cap the claim (and with it the
          * rescue inside it) was skipped. */
         for (r : 0 .. NROWS - 1) { live = live + (st[r] == PROC) };
         if
         :: live < CAP ->
              rescue_all(r);           /* the old store.claim(rescue_first=True) */
              live = 0;
              for (r : 0 .. NROWS - 1) { live = live + (st[r] == PROC) }
         :: else -> skip               /* skipped at the cap: no rescue either */
         fi;
#else
         /* `claim`'s room: the cap minus the live leases (the `in_flight`
          * count, lease_until >= now()); an expired lease holds nothing. */
         for (r : 0 .. NROWS - 1) { live = live + (st[r] == PROC && lease[r] != EXPIRED) };
#endif
         if
         :: live < CAP -> room = CAP - live
         :: else -> room = 0
         fi;
         for (n : 0 .. NROWS - 1) {
           r = (off + n) % NROWS;
           if
#ifdef HOLD_ALWAYS
           /* The hold without its queue rule: left while not aged, however
            * short the queue (the hold's age is not modelled, so nothing
            * ends it): liveness must fail. */
           :: room > 0 && st[r] == PENDING && aged ->
#else
           :: room > 0 && st[r] == PENDING && (aged || queued < HOLD_QUEUE) ->
#endif
                room--;
                queued++;
                ver[r]++;                        /* lease_version + 1 */
                assert(ver[r] < 16);
                begun[r] = 0; ended[r] = 0;
                if
                :: att[r] >= MAX_ATTEMPTS -> set_status(r, DEAD)  /* 'retries exhausted' */
                :: else ->
                     set_status(r, PROC);
                     lease[r] = FULL;            /* now() + lease */
                     claimed[r] = 1
                fi
           :: else -> skip
           fi
         };
         r = 0; n = 0; off = 0; room = 0; live = 0; queued = 0; aged = 0
       };
       /* The claim committed; then fanout.fan_out sends (id, lease_version). */
       if
       :: d_step {
            for (r : 0 .. NROWS - 1) {
              if
              :: claimed[r] -> send_task(r, i, j, t); claimed[r] = 0
              :: else -> skip
              fi
            };
            r = 0
          }
       :: CAN(fanfail) && ANY_CLAIMED ->
            /* fan_out's except branch: some tasks may have reached the
             * broker, and every claimed row is to be released */
            SPEND(fanfail);
            for (r : 0 .. NROWS - 1) {
              if
              :: claimed[r] ->
                   relv[r] = ver[r];
                   claimed[r] = 0;
                   if
                   :: send_task(r, i, j, t)
                   :: skip
                   fi
              :: else -> skip
              fi
            };
            r = 0
       fi
     }
  :: atomic {
       /* fanout.release -> store.finalize (queries.sql `finalize`): back to
        * pending, due now, nothing refunded (the claim counted nothing);
        * or the release itself fails ("could not release ...; their leases
        * will expire"). */
       ANY_RELV ->
       if
       :: d_step {
            for (r : 0 .. NROWS - 1) {
              if
              :: relv[r] != 0 -> release(r, relv[r], NW, i); relv[r] = 0
              :: else -> skip
              fi
            };
            r = 0
          }
       :: d_step {
            for (r : 0 .. NROWS - 1) { relv[r] = 0 };
            r = 0
          }
       fi
     }
  od
}

/* ----------------------------------------------------------------- rescuer */
/* tasks.rescue -> Rescuer.run_once -> store.rescue -> queries.sql `rescue`,
 * on its own beat entry, whatever the in-flight room: unconditional. */
#ifndef FREEZE_BUG
active proctype rescuer() {
  byte r;
  do
  :: d_step { rescue_all(r) }
  od
}
#endif

/* ------------------------------------------------------------------- clock */
/* The database clock (now()), steps per row. A lease nobody is working on
 * (a lost task, a crashed worker) runs out: free, and always eventually,
 * since the clock is a fair process and has no no-op step (so weak fairness
 * cannot let it idle while a forgotten lease waits). Over a lease whose
 * delivery is under way, time passes only as a LATE fault: one level
 * (FULL -> SHORT, SHORT -> EXPIRED), or a whole lease at once (a worker or
 * a broker queue that stalls for longer than the lease). */
#define TICK(r) \
  :: atomic { LIVE(r) && !PROSPECT(r) -> lease[r] = EXPIRED } \
  :: atomic { LIVE(r) && PROSPECT(r) && CAN(late) -> SPEND(late); lease[r]-- } \
  :: atomic { lease[r] == FULL && LIVE(r) && PROSPECT(r) && CAN(late) -> \
              SPEND(late); lease[r] = EXPIRED }

active proctype clock() {
  do
  TICK(0)
#if NROWS > 1
  TICK(1)
#endif
#if NROWS > 2
  TICK(2)
#endif
  od
}

/* ------------------------------------------------------------------ broker */
/* The broker loses a task (or it expires unrun: fan-out's `expires`), or
 * delivers one twice (redelivery, a producer retry). Delay and reordering
 * need no step: the bag has no order and a task may wait any time. */
active proctype broker() {
  byte i, j, t;
  do
  :: atomic {
       CAN(loss) && bagn > 0 -> SPEND(loss);
       select (i : 0 .. bagn - 1);
       t = 0;
       d_step { bag[i] = 0; bagn--; bag_sort(i, j, t) }
     }
  :: atomic {
       CAN(dup) && bagn > 0 && bagn < K -> SPEND(dup);
       select (i : 0 .. bagn - 1);
       t = 0;
       d_step { bag[bagn] = bag[i]; bagn++; bag_sort(i, j, t) }
     }
  od
}

/* ----------------------------------------------------------------- workers */
inline idle(w) {
  wst[w] = W_IDLE; wr[w] = 0; wv[w] = 0; watt[w] = 0; wout[w] = 0
}

/* tasks.deliver -> Deliverer.deliver: begin -> publish -> finalize, with the
 * LeaseKeeper renewing while it publishes. Each step is one statement. */
proctype worker(byte w) {
  byte i, j, t, r, s;
  do
  /* A worker takes any task from the broker and runs queries.sql
   * `begin_one` (store.begin, Deliverer.deliver), the fence check:
   *   WHERE id AND lease_version AND lease_until IS NOT NULL
   * It counts the attempt (count_attempt = 1, the Celery relay) only when
   * at least %(needed)s of lease is left; else the row comes back unstarted.
   * (Taking and beginning are one step: a crash in between is a lost task.) */
  :: atomic {
       wst[w] == W_IDLE && bagn > 0 ->
       select (i : 0 .. bagn - 1);
       t = 0;
       d_step {
         wr[w] = bag[i] / 16; wv[w] = bag[i] % 16;
         bag[i] = 0; bagn--;
         bag_sort(i, j, t);
         r = wr[w];
         if
         :: FENCE(r, wv[w]) ->
              NOT_STALE(r, wv[w]);
              if
              :: lease[r] == FULL ->
                   /* began_version (migration 0005): the attempt is
                    * counted by the first begin under a lease only */
                   if
                   :: begun[r] -> dupb[r]++          /* ghost */
                   :: else -> begun[r] = 1; att[r]++
                   fi;
                   check_attempts(r);
                   watt[w] = att[r];
                   wst[w] = W_BEGUN
              :: else -> wst[w] = W_NOTSTARTED
              fi
         :: else -> idle(w)        /* Deliverer._sort: "lease no longer ours" */
         fi;
         r = 0
       }
     }

  /* Deliverer._sort/_finish: give an unstarted row back at once via
   * queries.sql `finalize_one` (Outcome.release, refund_attempt =
   * not count_attempt = 0: begin counted nothing). */
  :: d_step {
       wst[w] == W_NOTSTARTED ->
       release(wr[w], wv[w], w, i);
       idle(w)
     }

  /* LeaseKeeper.renew_due -> store.extend_leases -> queries.sql
   * `extend_lease`: renews with less than half a lease left, only a live
   * lease (lease_until >= now()), fenced on the version. */
  :: d_step {
       wst[w] == W_BEGUN && RENEW_FENCE(wr[w], wv[w]) && lease[wr[w]] != FULL ->
       NOT_STALE(wr[w], wv[w]);
       lease[wr[w]] = FULL
     }

  /* Deliverer._publish: publish if hold.alive(); the hold estimates the
   * lease by the worker's clock since the database last answered, so when
   * the database lease is no longer a full one of ours either answer is
   * possible. The receiver records the delivery. */
  :: atomic {
       wst[w] == W_BEGUN -> r = wr[w];
       if
       :: st[r] == PROC && ver[r] == wv[w] && lease[r] == FULL -> wout[w] = O_OK
       :: else ->
            if
            :: wout[w] = O_OK
            :: wout[w] = O_NOTPUB          /* "lease was lost or ran short" */
            fi
       fi;
       if
       :: wout[w] == O_OK ->
            pub[r] = 1;
            if                             /* the publisher's result */
            :: wout[w] = O_OK
            :: wout[w] = O_RETRY
            fi
       :: else -> skip
       fi;
       wst[w] = W_PUBLISHED;
       r = 0
     }

  /* policy.classify, then queries.sql `finalize_one` (fenced). */
  :: d_step {
       wst[w] == W_PUBLISHED -> r = wr[w];
       if
       :: wout[w] == O_OK -> s = DONE
       :: wout[w] == O_RETRY && watt[w] >= MAX_ATTEMPTS -> s = DEAD   /* exhausted */
       :: wout[w] == O_RETRY && watt[w] < MAX_ATTEMPTS -> s = PENDING /* back-off */
       :: wout[w] == O_NOTPUB -> s = PENDING
       fi;
       if
       :: s == DONE && FENCE(r, wv[w]) ->
            assert(pub[r] > 0)             /* done only after a publish */
       :: else -> skip
       fi;
       finalize_one(r, wv[w], s, (wout[w] == O_NOTPUB));
       idle(w);
       r = 0; s = 0
     }

  /* A durable task's run that follows its task (celery/durable_run.py):
   * queries.sql `done_and_take_durable`, one statement: the fenced done and,
   * only if it went through, the lease and begin of any pending row (its
   * lease as a claim writes it, the attempt counted, marked begun, or dead
   * when out of attempts), which this worker then runs with no broker in
   * between. No cap is counted: the done ends a lease as the take begins
   * one. (Plain deliveries end through `finalize_one` above; the model
   * lets any worker end either way.) */
  :: atomic {
       wst[w] == W_PUBLISHED && wout[w] == O_OK && FENCE(wr[w], wv[w]) ->
       select (j : 0 .. NROWS - 1);
       t = 0;    /* a plain step: Spin allows no jump into a d_step */
       d_step {
         r = wr[w];
         assert(pub[r] > 0);                     /* done only after a publish */
         finalize_one(r, wv[w], DONE, 0);
         if
         :: st[j] == PENDING ->
              ver[j]++;                          /* lease_version + 1 */
              assert(ver[j] < 16);
              begun[j] = 0; ended[j] = 0;
              if
              :: att[j] >= MAX_ATTEMPTS -> set_status(j, DEAD); idle(w)
              :: else ->
                   set_status(j, PROC);
                   lease[j] = FULL;
                   begun[j] = 1; att[j]++;       /* began_version = lease_version */
                   check_attempts(j);
                   wr[w] = j; wv[w] = ver[j]; watt[w] = att[j]; wout[w] = 0;
                   wst[w] = W_BEGUN
              fi
         :: else -> idle(w)                      /* nothing to take */
         fi;
         r = 0; j = 0
       }
     }

  /* The worker process dies (or is killed) at any step: its task and
   * whatever it knew are gone; the worker comes back idle. */
  :: d_step {
       wst[w] != W_IDLE && CAN(crash) -> SPEND(crash);
       idle(w)
     }
  od
}

init {
  byte w;
  atomic {
    for (w : 0 .. NW - 1) { run worker(w) };
    w = 0
  }
}

/* ---------------------------------------------------------- invariants */
/* A worker that could finalize row r right now: its version is the row's
 * and the row is still leased. */
#define CAN_FINALIZE(w, r) (wst[w] != W_IDLE && wr[w] == r && st[r] == PROC && ver[r] == wv[w])
#define LIVE_HOLDER(w, r) ((wst[w] == W_BEGUN || wst[w] == W_PUBLISHED) \
                           && CAN_FINALIZE(w, r) && lease[r] != EXPIRED)

/* Never two valid holders of one row: at most one lease version of a row can
 * finalize (with EXCLUSIVE: at most one worker holds a live lease at all). */
#ifdef EXCLUSIVE
#define PAIR_OK(a, b, r) (!(LIVE_HOLDER(a, r) && LIVE_HOLDER(b, r)))
#else
#define PAIR_OK(a, b, r) (!(CAN_FINALIZE(a, r) && CAN_FINALIZE(b, r)) || wv[a] == wv[b])
#endif
#if NW == 2
#define ROW_OK(r) (PAIR_OK(0, 1, r))
#else
#define ROW_OK(r) (PAIR_OK(0, 1, r) && PAIR_OK(0, 2, r) && PAIR_OK(1, 2, r))
#endif
#if NROWS == 1
#define HOLDERS_OK (ROW_OK(0))
#elif NROWS == 2
#define HOLDERS_OK (ROW_OK(0) && ROW_OK(1))
#else
#define HOLDERS_OK (ROW_OK(0) && ROW_OK(1) && ROW_OK(2))
#endif

/* Evaluated in every reachable state (it may run at any point of any
 * interleaving). Left out of the liveness runs (-DNOMONITOR). */
#ifndef NOMONITOR
active proctype monitor() {
  do
  :: assert(HOLDERS_OK)
  od
}
#endif

/* Liveness: every row eventually ends done or dead. Checked with weak
 * fairness (pan -a -f): every process that stays enabled eventually moves. */
ltl live { <> ALL_FINISHED }
