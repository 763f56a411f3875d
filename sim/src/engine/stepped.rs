//! The stepped engine model: vLLM V1's scheduler, step by step, on a virtual clock. Pure: no
//! I/O, no real clock; the engine's driver task calls [`Scheduler::schedule`], waits the
//! returned step's duration, then calls [`Scheduler::complete`].
//!
//! # Scheduling (as vLLM V1's `Scheduler.schedule()` in `vllm/v1/core/sched/scheduler.py`)
//!
//! - A waiting queue (FCFS) and a running list, in admission order. Each request has a
//!   number of tokens (prompt plus output so far) and of computed tokens; a step gives each
//!   scheduled request some new tokens to compute. There is no prefill or decode phase: a
//!   decode is a request one token behind, a chunked prefill one many tokens behind.
//! - Every step has a budget of `max_num_batched_tokens` tokens. The running requests are
//!   served first, in order, each as many tokens as it lacks within what is left of the
//!   budget: decodes take 1 token each, an unfinished prefill takes the rest (it is the
//!   newest running request, so it comes after the decodes). Then, only if nobody was
//!   preempted in this step, waiting requests are admitted in order while the budget lasts,
//!   fewer than `max_num_seqs` run and their blocks fit; the first that does not fit stops
//!   the admissions (FCFS). An admitted prompt is chunked: it takes what the budget leaves
//!   and continues in the next steps.
//! - KV blocks: an admission takes the prompt's blocks (prefix-cache hits reused, see
//!   [`KvCache::try_admit_deferred`]); its new full blocks are cached as the chunks compute
//!   them. Decoding grows a request by one block per `block_size` tokens
//!   ([`KvCache::try_grow`]). When a running request cannot get its next block, the most
//!   recently admitted running request is preempted (FCFS policy: `self.running.pop()`): its
//!   blocks are freed, its computed tokens reset to 0, and it goes back to the front of the
//!   waiting queue, to be recomputed (prompt and the output so far, prefix hits included)
//!   when readmitted. If the victim is the request itself, it stops the running loop.
//! - A request whose computed tokens reach its token count samples a token at the end of the
//!   step: the first one ends its time to first token; the last one finishes it and frees
//!   its blocks.
//! - Defaults on one H100 (vLLM's `EngineArgs.get_batch_defaults`, `vllm/engine/arg_utils.py`:
//!   GPUs with at least 70 GiB other than A100 get `max_num_batched_tokens = 8192` for the
//!   OpenAI API server, and `max_num_seqs = 1024`; the simulator keeps its own
//!   `max_running`, 256, for both models, since the KV cache binds long before either).
//!
//! Simplifications: no speculative decoding, no `long_prefill_token_threshold` (0, off, by
//! default), no async scheduling (one step in flight), and KV events are published when the
//! scheduler decides (evictions) or the step completes (stored blocks), one batch each.
//!
//! # Step cost (one H100 SXM, Llama-3.1-8B bf16: the facts of the engine's module docs)
//!
//! `step = max(weight_read, (prefill_tokens + decode_seqs) / prefill_tokens_per_s)
//!        + Σ over decodes of context_tokens · kv_read_per_token`
//!
//! - A forward pass reads the 16 GB of weights once from 3.35 TB/s HBM3: at least
//!   `weight_read = 4.8 ms`, the floor of a step (a roofline: small batches are bound by
//!   memory, large ones by compute, and the two overlap).
//! - Every token a step computes, prompt or decode, costs the same 2 · 8e9 FLOP in the linear
//!   layers: `1 / prefill_tokens_per_s` (20 k tokens/s, 50 µs) of compute.
//! - Each decode also reads its context's KV cache: 128 KiB per token / 3.35 TB/s =
//!   `kv_read_per_token = 39 ns` (attention reads of a prefill are left in the MFU).
//!
//! So a batch of 32 decodes of 1 k-token contexts takes 4.8 + 1.25 = 6 ms per token, 64 of
//! 2 k tokens 4.8 + 5 = 10 ms (the serial model's fixed 8 ms sits between), and a full
//! 8,192-token prefill step 410 ms plus whatever decodes ride along: decoding requests slow
//! the prefill down and take budget from it, which the serial model does not show.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kvroute::event::EngineHash;

use crate::cache::{AdmitError, CacheEvent, KvCache, RequestId};

/// Costs of the stepped model. Defaults: see the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCosts {
    /// Shortest step: reading the weights once (simulated; default 4.8 ms).
    pub weight_read: Duration,
    /// KV read per context token of each decode in a step (simulated; default 39 ns).
    pub kv_read_per_token: Duration,
}

impl Default for StepCosts {
    fn default() -> Self {
        StepCosts {
            weight_read: Duration::from_micros(4_800),
            kv_read_per_token: Duration::from_nanos(39),
        }
    }
}

/// Settings of one rank's scheduler.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedConfig {
    /// Tokens one step computes (vLLM `max_num_batched_tokens`).
    pub budget_tokens: usize,
    /// Requests running at once (vLLM `max_num_seqs`).
    pub max_running: usize,
    /// Compute per token, tokens per simulated second.
    pub prefill_tokens_per_s: f64,
    /// The rest of the step's cost.
    pub costs: StepCosts,
}

/// The engine's handle of a request in the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub u64);

/// A request the scheduler holds.
#[derive(Debug)]
struct Req {
    key: Key,
    prompt: Arc<Vec<u32>>,
    hashes: Vec<EngineHash>,
    output_tokens: usize,
    /// Tokens sampled so far.
    generated: usize,
    /// Tokens whose KV is computed (0 again after a preemption).
    computed: usize,
    /// The cache's id while it holds blocks (running).
    blocks: Option<RequestId>,
    /// Simulated arrival time: not admitted to a step that starts earlier.
    arrived: Duration,
    /// Admitted at least once (stats and the cached-token figure count the first admission).
    admitted: bool,
}

impl Req {
    /// Prompt plus output so far: the tokens whose KV the next sample needs.
    fn tokens(&self) -> usize {
        self.prompt.len() + self.generated
    }

    /// One token behind: a decode, not a (re)prefill chunk.
    fn decoding(&self) -> bool {
        self.generated > 0 && self.computed + 1 == self.tokens()
    }
}

/// The first admission of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstAdmission {
    pub key: Key,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// One step as scheduled: what it computes and how long it takes.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Simulated start of the step.
    pub start: Duration,
    /// Simulated duration (see the module docs); zero when nothing was scheduled.
    pub duration: Duration,
    /// Requests and their new tokens, in running order.
    pub scheduled: Vec<(Key, usize)>,
    /// Prompt (and recompute) tokens in the step.
    pub prefill_tokens: usize,
    /// Decoding requests in the step (one token each).
    pub decode_seqs: usize,
    /// Requests preempted while scheduling this step.
    pub preempted: Vec<Key>,
    /// Requests admitted for the first time.
    pub admitted: Vec<FirstAdmission>,
    /// Cache changes made while scheduling (evictions), in order.
    pub events: Vec<CacheEvent>,
}

/// A token sampled at the end of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sampled {
    pub key: Key,
    /// Output tokens so far, this one included (1: the first token).
    pub generated: usize,
    /// The last one: the request is finished and its blocks are free.
    pub finished: bool,
}

/// What a completed step produced.
#[derive(Debug, Default)]
pub struct Completion {
    /// Simulated end of the step.
    pub at: Duration,
    pub sampled: Vec<Sampled>,
    /// Blocks the step's chunks computed, now cached, in order.
    pub events: Vec<CacheEvent>,
}

/// One rank's scheduler. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedConfig,
    /// Bounded by the engine's open requests (each has a client waiting on it).
    waiting: VecDeque<Req>,
    /// At most `max_running`.
    running: Vec<Req>,
    now: Duration,
    preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Scheduler {
        Scheduler {
            cfg: SchedConfig {
                budget_tokens: cfg.budget_tokens.max(1),
                max_running: cfg.max_running.max(1),
                ..cfg
            },
            waiting: VecDeque::new(),
            running: Vec::new(),
            now: Duration::ZERO,
            preemptions: 0,
        }
    }

    /// The virtual clock: the end of the last completed step, or where it was moved to.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// Moves the clock forward to `t` (an idle engine waiting for arrivals; a driver that
    /// fell behind real time). Never backwards.
    pub fn advance_to(&mut self, t: Duration) {
        self.now = self.now.max(t);
    }

    /// Requests waiting (new and preempted).
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests running (holding blocks).
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Anything to schedule, now or at a later arrival.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Arrival of the waiting queue's head (the clock an idle engine jumps to).
    pub fn next_arrival(&self) -> Option<Duration> {
        self.waiting.front().map(|r| r.arrived)
    }

    /// Queues a request that arrived at simulated time `arrived` (`hashes` are its prompt's
    /// engine hashes, `output_tokens` at least 1).
    pub fn add(
        &mut self,
        key: Key,
        prompt: Arc<Vec<u32>>,
        hashes: Vec<EngineHash>,
        output_tokens: usize,
        arrived: Duration,
    ) {
        self.waiting.push_back(Req {
            key,
            prompt,
            hashes,
            output_tokens: output_tokens.max(1),
            generated: 0,
            computed: 0,
            blocks: None,
            arrived,
            admitted: false,
        });
    }

    /// Drops a request (its client went away), freeing its blocks. False if unknown.
    pub fn abort(&mut self, key: Key, cache: &mut KvCache) -> bool {
        if let Some(i) = self.waiting.iter().position(|r| r.key == key) {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self.running.iter().position(|r| r.key == key) {
            let r = self.running.remove(i);
            if let Some(id) = r.blocks {
                cache.finish(id);
            }
            return true;
        }
        false
    }

    /// Schedules the next step, starting at [`Scheduler::now`]: allocates its blocks,
    /// preempts if it must, admits arrivals. The clock moves at [`Scheduler::complete`].
    pub fn schedule(&mut self, cache: &mut KvCache) -> Plan {
        let mut plan = Plan {
            start: self.now,
            ..Plan::default()
        };
        let mut budget = self.cfg.budget_tokens;
        let mut kv_reads = 0usize;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let r = &self.running[i];
            let n = (r.tokens() - r.computed).min(budget);
            let target = r.computed + n;
            let scheduled = loop {
                let id = self.running[i]
                    .blocks
                    .expect("running requests hold blocks");
                match cache.try_grow(id, target) {
                    Ok(ev) => {
                        plan.events.extend(ev);
                        break true;
                    }
                    Err(_) => {
                        let victim = self.running.pop().expect("request i is running");
                        let itself = self.running.len() == i;
                        plan.preempted.push(victim.key);
                        self.preempt(victim, cache);
                        if itself {
                            break false;
                        }
                    }
                }
            };
            if !scheduled {
                break;
            }
            let r = &self.running[i];
            if r.decoding() {
                plan.decode_seqs += 1;
                kv_reads += r.computed;
            } else {
                plan.prefill_tokens += n;
            }
            plan.scheduled.push((r.key, n));
            budget -= n;
            i += 1;
        }
        if plan.preempted.is_empty() {
            while budget > 0 && self.running.len() < self.cfg.max_running {
                let Some(head) = self.waiting.front() else {
                    break;
                };
                if head.arrived > self.now {
                    break;
                }
                match cache.try_admit_deferred(&head.prompt, &head.hashes, head.generated) {
                    Err(AdmitError::NotEnoughFree { .. }) => break,
                    Err(AdmitError::TooLarge { .. }) => {
                        // The engine refuses these before queueing them; never stall on one.
                        self.waiting.pop_front();
                        continue;
                    }
                    Ok(adm) => {
                        let mut r = self.waiting.pop_front().expect("head");
                        plan.events.extend(adm.events);
                        r.computed = adm.cached_tokens;
                        r.blocks = Some(adm.request);
                        if !r.admitted {
                            r.admitted = true;
                            plan.admitted.push(FirstAdmission {
                                key: r.key,
                                prompt_tokens: r.prompt.len(),
                                cached_tokens: adm.cached_tokens,
                            });
                        }
                        // The last prompt token is never a hit, so n >= 1.
                        let n = (r.tokens() - r.computed).min(budget);
                        plan.prefill_tokens += n;
                        plan.scheduled.push((r.key, n));
                        budget -= n;
                        self.running.push(r);
                    }
                }
            }
        }
        if !plan.scheduled.is_empty() {
            plan.duration = self.step_time(plan.prefill_tokens, plan.decode_seqs, kv_reads);
        }
        plan
    }

    /// The step's duration for its computed tokens and its decodes' context tokens.
    fn step_time(&self, prefill_tokens: usize, decode_seqs: usize, kv_tokens: usize) -> Duration {
        let compute = Duration::from_secs_f64(
            (prefill_tokens + decode_seqs) as f64 / self.cfg.prefill_tokens_per_s.max(1e-9),
        );
        let kv = self
            .cfg
            .costs
            .kv_read_per_token
            .saturating_mul(kv_tokens.min(u32::MAX as usize) as u32);
        compute.max(self.cfg.costs.weight_read) + kv
    }

    /// Ends the step `plan` scheduled: the clock moves to its end, its tokens are computed,
    /// requests that caught up sample a token, finished ones free their blocks. Requests
    /// aborted since `plan` are skipped.
    pub fn complete(&mut self, plan: Plan, cache: &mut KvCache) -> Completion {
        self.now = self.now.max(plan.start + plan.duration);
        let mut done = Completion {
            at: self.now,
            ..Completion::default()
        };
        // `scheduled` is in running order, and aborts only remove: one pass over both.
        let mut next = plan.scheduled.iter().peekable();
        let mut i = 0;
        while i < self.running.len() {
            let Some(&&(key, n)) = next.peek() else {
                break;
            };
            let r = &mut self.running[i];
            if r.key != key {
                if self.running[i..].iter().all(|x| x.key != key) {
                    next.next(); // aborted meanwhile
                } else {
                    i += 1;
                }
                continue;
            }
            next.next();
            r.computed += n;
            if let Some(id) = r.blocks {
                done.events
                    .extend(cache.commit(id, &r.prompt, &r.hashes, r.computed));
            }
            if r.computed < r.tokens() {
                i += 1;
                continue;
            }
            r.generated += 1;
            let finished = r.generated >= r.output_tokens;
            done.sampled.push(Sampled {
                key,
                generated: r.generated,
                finished,
            });
            if finished {
                let r = self.running.remove(i);
                if let Some(id) = r.blocks {
                    cache.finish(id);
                }
            } else {
                i += 1;
            }
        }
        done
    }

    /// [`Scheduler::schedule`] then [`Scheduler::complete`]: one whole step (tests).
    pub fn step(&mut self, cache: &mut KvCache) -> (Plan, Completion) {
        let plan = self.schedule(cache);
        let view = plan.clone();
        let done = self.complete(plan, cache);
        (view, done)
    }

    fn preempt(&mut self, mut r: Req, cache: &mut KvCache) {
        if let Some(id) = r.blocks.take() {
            cache.finish(id);
        }
        r.computed = 0;
        self.preemptions += 1;
        self.waiting.push_front(r);
    }
}

#[cfg(test)]
mod tests {
    //! The scheduler driven step by step on its virtual clock.
    use super::*;
    use crate::cache::CacheConfig;
    use crate::engine_hash::HashScheme;

    const BS: usize = 16;

    fn setup(budget: usize, capacity_blocks: usize) -> (Scheduler, KvCache) {
        let s = Scheduler::new(SchedConfig {
            budget_tokens: budget,
            max_running: 256,
            prefill_tokens_per_s: 20_000.0,
            costs: StepCosts::default(),
        });
        let c = KvCache::new(
            CacheConfig {
                block_size_tokens: BS,
                capacity_blocks,
            },
            HashScheme::vllm("sched"),
        );
        (s, c)
    }

    /// A prompt of `len` tokens, distinct per `family`.
    fn prompt(family: u32, len: usize) -> Arc<Vec<u32>> {
        Arc::new((0..len as u32).map(|i| family * 1_000_000 + i).collect())
    }

    fn add(s: &mut Scheduler, c: &KvCache, key: u64, p: &Arc<Vec<u32>>, out: usize) {
        let now = s.now();
        s.add(Key(key), p.clone(), c.engine_hashes(p), out, now);
    }

    /// Steps until `key` samples its first token; returns that step's end.
    fn run_to_first_token(s: &mut Scheduler, c: &mut KvCache, key: u64) -> Duration {
        for _ in 0..10_000 {
            let (_, done) = s.step(c);
            if done
                .sampled
                .iter()
                .any(|x| x.key == Key(key) && x.generated == 1)
            {
                return done.at;
            }
        }
        panic!("no first token for {key}");
    }

    /// Steps until nothing is left; returns every step.
    fn run_to_end(s: &mut Scheduler, c: &mut KvCache) -> Vec<(Plan, Completion)> {
        let mut steps = Vec::new();
        while s.has_work() {
            steps.push(s.step(c));
            assert!(steps.len() < 100_000, "no progress");
        }
        steps
    }

    #[test]
    fn the_token_budget_is_respected_every_step() {
        let (mut s, mut c) = setup(512, 10_000);
        for k in 0..40u64 {
            let len = 50 + (k as usize * 337) % 1500;
            add(&mut s, &c, k, &prompt(k as u32, len), 1 + (k as usize % 30));
        }
        let steps = run_to_end(&mut s, &mut c);
        assert!(steps.len() > 40);
        for (plan, _) in &steps {
            let total: usize = plan.scheduled.iter().map(|x| x.1).sum();
            assert!(total <= 512, "{total} tokens in one step");
            assert_eq!(total, plan.prefill_tokens + plan.decode_seqs);
        }
        assert!(steps
            .iter()
            .any(|(p, _)| p.scheduled.iter().map(|x| x.1).sum::<usize>() == 512));
        let sampled: usize = steps.iter().map(|(_, d)| d.sampled.len()).sum();
        assert_eq!(
            sampled,
            (0..40).map(|k| 1 + k % 30).sum::<usize>(),
            "every token once"
        );
        assert_eq!(c.used_blocks(), 0, "every block freed");
    }

    #[test]
    fn decodes_are_scheduled_before_prefill_chunks() {
        let (mut s, mut c) = setup(1024, 10_000);
        for k in 0..8 {
            add(&mut s, &c, k, &prompt(k as u32, 100), 50);
        }
        run_to_first_token(&mut s, &mut c, 7);
        add(&mut s, &c, 99, &prompt(99, 5_000), 1);
        let (plan, _) = s.step(&mut c);
        assert_eq!(plan.decode_seqs, 8);
        assert_eq!(plan.scheduled.len(), 9);
        for (k, n) in &plan.scheduled[..8] {
            assert!(
                k.0 < 8 && *n == 1,
                "decodes first, one token each: {plan:?}"
            );
        }
        assert_eq!(
            plan.scheduled[8],
            (Key(99), 1024 - 8),
            "the chunk takes what is left"
        );
        // The next step: the same order, the chunk still behind the decodes.
        let (plan, _) = s.step(&mut c);
        assert_eq!(plan.scheduled[8], (Key(99), 1024 - 8));
    }

    #[test]
    fn a_long_prompt_is_chunked_across_steps() {
        let (mut s, mut c) = setup(8192, 10_000);
        add(&mut s, &c, 1, &prompt(1, 20_000), 2);
        let mut chunks = Vec::new();
        let mut first_at = None;
        while first_at.is_none() {
            let (plan, done) = s.step(&mut c);
            chunks.push(plan.scheduled[0].1);
            if !done.sampled.is_empty() {
                first_at = Some(done.at);
            }
        }
        assert_eq!(chunks, vec![8192, 8192, 3616]);
        // 20,000 tokens at 20 k/s: one second of compute, no step under its weight read.
        let first_at = first_at.unwrap();
        assert!((first_at.as_secs_f64() - 1.0).abs() < 1e-6, "{first_at:?}");
        let (plan, done) = s.step(&mut c);
        assert_eq!((plan.decode_seqs, plan.prefill_tokens), (1, 0));
        assert!(done.sampled[0].finished);
        assert_eq!(
            plan.duration,
            StepCosts::default().weight_read + Duration::from_nanos(39 * 20_000),
            "a lone decode: the weight read and its context's KV"
        );
    }

    /// Time to first token of a 4,096-token prompt arriving after `decodes` requests with
    /// 2,000-token prompts are decoding.
    fn ttft_behind_decodes(decodes: u64) -> Duration {
        let (mut s, mut c) = setup(8192, 25_000);
        for k in 0..decodes {
            add(&mut s, &c, k, &prompt(k as u32, 2_000), 1_000);
        }
        if decodes > 0 {
            run_to_first_token(&mut s, &mut c, decodes - 1);
        }
        let arrived = s.now();
        add(&mut s, &c, 999, &prompt(999, 4_096), 1);
        run_to_first_token(&mut s, &mut c, 999) - arrived
    }

    #[test]
    fn ttft_under_running_decodes_is_longer_than_on_an_idle_engine() {
        let idle = ttft_behind_decodes(0);
        let busy = ttft_behind_decodes(128);
        assert!(
            (idle.as_secs_f64() - 4096.0 / 20_000.0).abs() < 1e-6,
            "idle: the prompt's compute: {idle:?}"
        );
        // 128 decodes ride in the prefill's step: 128 tokens of compute and 128 contexts of
        // ~2,000 tokens of KV reads (~10 ms) on top of the 205 ms prefill.
        assert!(
            busy > idle + Duration::from_millis(12),
            "{busy:?} vs {idle:?}"
        );
    }

    #[test]
    fn kv_exhaustion_preempts_the_newest_running_request_which_later_completes() {
        // 50 blocks of 16 tokens: three prompts of 10 blocks each, each growing by 20 blocks.
        let (mut s, mut c) = setup(8192, 50);
        for k in 1..=3 {
            add(&mut s, &c, k, &prompt(k as u32, 160), 320);
        }
        let steps = run_to_end(&mut s, &mut c);
        let preempted: Vec<Key> = steps
            .iter()
            .flat_map(|(p, _)| p.preempted.clone())
            .collect();
        assert!(!preempted.is_empty(), "the cache runs out");
        assert_eq!(
            preempted[0],
            Key(3),
            "the newest running request goes first"
        );
        assert!(
            !preempted.contains(&Key(1)),
            "the oldest is never the victim"
        );
        assert_eq!(s.preemptions(), preempted.len() as u64);
        let finished: Vec<Key> = steps
            .iter()
            .flat_map(|(_, d)| d.sampled.iter().filter(|x| x.finished).map(|x| x.key))
            .collect();
        assert_eq!(finished.len(), 3, "all complete");
        assert_eq!(finished[0], Key(1), "the oldest first");
        for k in 1..=3 {
            let tokens: Vec<usize> = steps
                .iter()
                .flat_map(|(_, d)| d.sampled.iter().filter(|x| x.key == Key(k)))
                .map(|x| x.generated)
                .collect();
            assert_eq!(
                tokens,
                (1..=320).collect::<Vec<_>>(),
                "{k}: none lost or repeated"
            );
        }
        // The recompute covers the prompt (a prefix hit: its blocks stayed cached) and the
        // output so far, in a chunk, not a decode.
        let i = steps
            .iter()
            .position(|(p, _)| !p.preempted.is_empty())
            .unwrap();
        let (resume, _) = steps[i + 1..]
            .iter()
            .find(|(p, _)| p.admitted.is_empty() && p.scheduled.iter().any(|x| x.0 == Key(3)))
            .unwrap();
        let n = resume.scheduled.iter().find(|x| x.0 == Key(3)).unwrap().1;
        assert!(n > 1, "a recompute chunk: {n}");
        assert_eq!(c.used_blocks(), 0);
    }

    #[test]
    fn prefix_cache_hits_shorten_prefill() {
        let (mut s, mut c) = setup(8192, 10_000);
        let p = prompt(5, 6_000);
        add(&mut s, &c, 1, &p, 1);
        let t0 = s.now();
        let cold = run_to_first_token(&mut s, &mut c, 1) - t0;
        let mut tail = (*p).clone();
        tail.extend(0..500);
        let t1 = s.now();
        s.add(
            Key(2),
            Arc::new(tail.clone()),
            c.engine_hashes(&tail),
            1,
            t1,
        );
        let (plan, _) = s.step(&mut c);
        assert_eq!(plan.admitted[0].cached_tokens, 6_000);
        assert_eq!(plan.prefill_tokens, 500);
        let warm = s.now() - t1;
        assert!(warm * 5 < cold, "{warm:?} vs {cold:?}");
    }

    #[test]
    fn a_request_arriving_during_a_chunked_prefill_hits_only_computed_blocks() {
        let (mut s, mut c) = setup(4096, 10_000);
        let p = prompt(3, 12_000);
        add(&mut s, &c, 1, &p, 1);
        let (_, done) = s.step(&mut c);
        assert!(
            matches!(&done.events[..], [CacheEvent::BlockStored { hashes, .. }] if hashes.len() == 256),
            "the first chunk's blocks are cached when computed"
        );
        add(&mut s, &c, 2, &p, 1);
        let (plan, _) = s.step(&mut c);
        assert_eq!(plan.scheduled[0], (Key(1), 4096));
        assert!(plan.admitted.is_empty(), "no budget left for the second");
        let (plan, _) = s.step(&mut c);
        assert_eq!(plan.scheduled[0], (Key(1), 12_000 - 8192));
        assert_eq!(
            plan.admitted[0].cached_tokens, 8192,
            "two chunks computed, not three"
        );
    }

    #[test]
    fn requests_are_not_admitted_before_they_arrive() {
        let (mut s, mut c) = setup(8192, 10_000);
        let p = prompt(1, 100);
        s.add(
            Key(1),
            p.clone(),
            c.engine_hashes(&p),
            1,
            Duration::from_millis(50),
        );
        assert!(s.schedule(&mut c).scheduled.is_empty());
        assert_eq!(s.next_arrival(), Some(Duration::from_millis(50)));
        s.advance_to(Duration::from_millis(50));
        let (plan, done) = s.step(&mut c);
        assert_eq!(plan.start, Duration::from_millis(50));
        assert!(done.sampled[0].finished);
    }

    #[test]
    fn an_aborted_request_frees_its_blocks_and_samples_nothing() {
        let (mut s, mut c) = setup(1024, 10_000);
        add(&mut s, &c, 1, &prompt(1, 3_000), 5);
        add(&mut s, &c, 2, &prompt(2, 3_000), 5);
        let plan = s.schedule(&mut c);
        assert!(s.abort(Key(1), &mut c));
        let done = s.complete(plan, &mut c);
        assert!(done.sampled.is_empty());
        assert!(s.abort(Key(2), &mut c), "still waiting");
        assert!(!s.abort(Key(2), &mut c));
        assert_eq!((s.running(), s.waiting(), c.used_blocks()), (0, 0, 0));
    }

    /// The gateway learns an engine's prefill rate from requests that found its prefill
    /// idle: their prefill tokens over their time to first token, folded in a quarter at a
    /// time (`kvroute::mirror::{rate_sample, learn_rate}`). Under the stepped model that time
    /// includes the decodes riding in each chunk's step, so the estimate settles at the
    /// engine's effective rate under that decode load, below the configured compute rate.
    #[test]
    fn the_learned_prefill_rate_converges_under_the_stepped_model() {
        use kvroute::mirror::{learn_rate, rate_sample};
        for decodes in [0u64, 64] {
            let (mut s, mut c) = setup(8192, 25_000);
            for k in 0..decodes {
                add(&mut s, &c, k, &prompt(k as u32, 1_000), 100_000);
            }
            if decodes > 0 {
                run_to_first_token(&mut s, &mut c, decodes - 1);
            }
            let mut rate = 0u32;
            let mut history = Vec::new();
            for i in 0..24u64 {
                let len = 6_000 + (i as usize * 1_733) % 6_000;
                let key = 1_000 + i;
                let arrived = s.now();
                add(&mut s, &c, key, &prompt(key as u32, len), 1);
                let ttft = run_to_first_token(&mut s, &mut c, key) - arrived;
                let sample = rate_sample(len as u32, ttft.as_millis() as u64).unwrap();
                rate = learn_rate(rate, sample);
                history.push(rate);
            }
            let last = *history.last().unwrap() as f64;
            let spread = history[16..]
                .iter()
                .map(|&r| (r as f64 - last).abs() / last)
                .fold(0.0, f64::max);
            assert!(
                spread < 0.03,
                "settled over the last 8 samples: {history:?}"
            );
            if decodes == 0 {
                assert!((last - 20_000.0).abs() / 20_000.0 < 0.02, "{history:?}");
            } else {
                // Each 8,192-token step carries 64 decode tokens and 64 · ~1,000 context
                // tokens of KV reads (2.5 ms): ~1 % below the compute rate.
                assert!(last < 19_900.0 && last > 18_500.0, "{history:?}");
            }
        }
    }
}
