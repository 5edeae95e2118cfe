//! The looped family as the engine core drives it ([`Half`]).

use super::executor::{ExecutorPending, LoopedExecutor};
use super::launch::{LoopedLaunch, LoopedResult, LoopedRow, LoopedScheduler, Stage};
use crate::engine::{Completed, EngineMetrics, FamilyMetrics, Half, Issued, LaunchCost, Live};
use crate::request::{RequestId, TokenCompute};
use crate::sampling::RowSampling;
use crate::scheduler::Requests;
use std::collections::HashMap;

/// A looped model: its runner, scheduler, and the launch in flight under overlap.
pub(crate) struct LoopedHalf {
    pub runner: LoopedExecutor,
    pub scheduler: Box<dyn LoopedScheduler>,
    pub overlap: bool,
    pub in_flight: Option<Issued<LoopedLaunch, ExecutorPending>>,
}

impl Half for LoopedHalf {
    type Launch = LoopedLaunch;
    type Pending = ExecutorPending;
    type Result = LoopedResult;

    fn scheduler_name(&self) -> &'static str {
        self.scheduler.name()
    }
    fn finished(&mut self, id: RequestId) {
        self.scheduler.finished(id);
    }
    fn schedule(&mut self, requests: &mut Requests) -> Option<LoopedLaunch> {
        self.scheduler.schedule(requests)
    }
    fn launch_requests(launch: &LoopedLaunch) -> Vec<RequestId> {
        launch.rows.iter().map(|r| r.request).collect()
    }
    fn shape(launch: &LoopedLaunch) -> (&'static str, usize, usize) {
        (launch.stage.name(), launch.rows.len(), launch.num_tokens())
    }
    fn cost(&self, launch: &LoopedLaunch) -> Option<LaunchCost> {
        Some(super::roofline::looped_launch_cost(self.runner.spec(), launch))
    }

    fn issue(&mut self, launch: &LoopedLaunch, live: &mut HashMap<RequestId, Live>) -> crate::Result<ExecutorPending> {
        let sampling: Vec<RowSampling> = launch
            .rows
            .iter()
            .map(|r| match (r.sample, live.get_mut(&r.request)) {
                (true, Some(l)) => l.next_sampling_row(),
                _ => RowSampling::greedy(),
            })
            .collect();
        self.runner.launch(launch, &sampling)
    }

    fn collect(&mut self, pending: ExecutorPending) -> crate::Result<LoopedResult> {
        self.runner.collect(pending)
    }

    fn complete(&mut self, requests: &mut Requests, launch: &LoopedLaunch, result: LoopedResult, metrics: &mut EngineMetrics) -> Completed {
        if let Some(span) = self.runner.last_device_time() {
            metrics.record_device(launch.stage.name(), span);
        }
        self.scheduler.complete(requests, launch, &result);
        if let FamilyMetrics::Looped(m) = &mut metrics.family {
            let g = self.runner.graph_stats();
            (m.graph_captures, m.graph_replays, m.graph_nodes) = (g.captures, g.replays, g.nodes);
            m.depth_histogram.clear();
            m.depth_histogram.extend_from_slice(self.scheduler.depth_histogram());
        }
        // A coda row's token ran its item's loop steps (the row's step is the last one run); a
        // full-depth launch runs every step it lists.
        let steps = |row: &LoopedRow| match launch.stage {
            Stage::Coda => Some(TokenCompute::LoopSteps(row.step as u32 + 1)),
            Stage::Prefill | Stage::FullDepthDecode => Some(TokenCompute::LoopSteps(launch.step_slots.len() as u32)),
            Stage::CoreStep => None,
        };
        let tokens = launch.rows.iter().zip(result.rows).filter_map(|(row, out)| out.token.map(|t| (out.request, t, out.logprob, steps(row)))).collect();
        Completed { tokens, non_finite: result.non_finite }
    }

    fn start_overlap(&mut self) -> crate::Result<()> {
        if !self.scheduler.supports_overlap() {
            return Err(crate::Error::InvalidOption(format!(
                "scheduler `{}` cannot overlap launches with its gate (it needs each step's signal before the next launch)",
                self.scheduler.name()
            )));
        }
        self.overlap = true;
        Ok(())
    }
    fn stop_overlap(&mut self) -> Option<Issued<LoopedLaunch, ExecutorPending>> {
        self.overlap = false;
        self.in_flight.take()
    }
    fn swap_in_flight(&mut self, next: Option<Issued<LoopedLaunch, ExecutorPending>>) -> Option<Issued<LoopedLaunch, ExecutorPending>> {
        if self.overlap {
            std::mem::replace(&mut self.in_flight, next)
        } else {
            next
        }
    }
    fn has_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }
}
