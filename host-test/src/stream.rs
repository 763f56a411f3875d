//! A stream's state as the driver moves it through the filter: both directions, what the
//! filter holds, what left it, and the phase it is in.

use std::collections::{HashMap, VecDeque};

use crate::headers::Headers;
use crate::types::{LocalResponse, Response, StreamState};

/// A property path and value.
pub(crate) type Property = (Vec<String>, Vec<u8>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Request,
    Response,
}

#[derive(Default)]
pub(crate) struct Dir {
    pub headers: Option<Headers>,
    pub headers_delivered: bool,
    pub chunks: VecDeque<Vec<u8>>,
    pub trailers: Option<Headers>,
    pub trailers_delivered: bool,
    /// The filter holds this direction (returned Pause and did not continue yet).
    pub held: bool,
    /// Held with StopAllIterationAndWatermark: no callback until the filter continues.
    pub stop_all: bool,
    /// `proxy_continue_stream` arrived.
    pub resume: bool,
    pub out_headers: Option<Headers>,
    pub out_body: Vec<u8>,
    pub out_trailers: Option<Headers>,
}

impl Dir {
    pub(crate) fn new(headers: Headers, body: Vec<Vec<u8>>, trailers: Option<Headers>) -> Dir {
        Dir {
            headers: Some(headers),
            chunks: body.into_iter().filter(|c| !c.is_empty()).collect(),
            trailers,
            ..Dir::default()
        }
    }

    pub(crate) fn end_of_stream(&self) -> bool {
        self.chunks.is_empty() && (self.trailers.is_none() || self.trailers_delivered)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Request,
    AwaitingResponse,
    Response,
    Done,
}

pub(crate) struct Stream {
    pub worker: usize,
    pub ctx: u32,
    pub phase: Phase,
    pub state: StreamState,
    pub req: Dir,
    pub resp: Dir,
    pub hold_response: bool,
    pub canned_response: Option<Response>,
    pub local: Option<LocalResponse>,
    /// A local reply sent during the response phase replaces the response outright.
    pub response_override: Option<Response>,
    pub reset: bool,
    pub fuel: u64,
    pub final_response: Option<Response>,
    pub override_host: Option<String>,
    pub properties: Vec<(Vec<String>, Vec<u8>)>,
}

impl Stream {
    pub(crate) fn dir(&mut self, side: Side) -> &mut Dir {
        match side {
            Side::Request => &mut self.req,
            Side::Response => &mut self.resp,
        }
    }
}

pub(crate) enum Flow {
    Waiting,
    Complete,
    Ended,
}

pub(crate) struct RequestSpec {
    pub headers: Headers,
    pub body: Vec<Vec<u8>>,
    pub trailers: Option<Headers>,
    pub worker: Option<usize>,
    pub properties: HashMap<Vec<String>, Vec<u8>>,
    pub response: Option<Response>,
    pub hold_response: bool,
}
