//! Who may be connected to the control socket, and what was refused: connections capped
//! in all and per user, and every refusal counted by its reason (`status`, metrics),
//! logged the first time. Shared by the connection threads.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
};

use hocus_control::status::ControlStatus;

/// How many clients may be connected at once.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub total: usize,
    pub per_user: usize,
}

/// Who is connected, and what was refused: shared by the connection threads.
pub struct Gate {
    limits: Limits,
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    total: usize,
    by_user: HashMap<u32, usize>,
    refused: BTreeMap<String, u64>,
}

impl Gate {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            state: Mutex::default(),
        }
    }

    /// Counts a refusal; the first of each kind is logged.
    pub fn refuse(&self, reason: &str, detail: &str) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let n = s.refused.entry(reason.to_owned()).or_default();
        *n += 1;
        if *n == 1 {
            log::warn!(
                "control socket: refused a client ({reason}): {detail}; counted from now on"
            );
        } else {
            log::debug!("control socket: refused a client ({reason}): {detail}");
        }
    }

    /// Admits a connection from `uid`, or says which limit it hit.
    pub fn admit(self: &Arc<Self>, uid: u32) -> Result<Admitted, &'static str> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.total >= self.limits.total {
            return Err("too_many_clients");
        }
        let mine = s.by_user.entry(uid).or_default();
        if *mine >= self.limits.per_user {
            return Err("too_many_clients_of_user");
        }
        *mine += 1;
        s.total += 1;
        Ok(Admitted {
            gate: Arc::clone(self),
            uid,
        })
    }

    pub fn status(&self) -> ControlStatus {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        ControlStatus {
            clients: s.total,
            max_clients: self.limits.total,
            max_clients_per_user: self.limits.per_user,
            refused: s.refused.clone(),
        }
    }
}

/// A connection counted against the limits until dropped.
pub struct Admitted {
    gate: Arc<Gate>,
    uid: u32,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut s = self.gate.state.lock().unwrap_or_else(|e| e.into_inner());
        s.total -= 1;
        if let Some(n) = s.by_user.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                s.by_user.remove(&self.uid);
            }
        }
    }
}

/// What the daemon reads about its control socket.
#[derive(Clone)]
pub struct Control(pub(super) Arc<Gate>);

impl Control {
    pub fn status(&self) -> ControlStatus {
        self.0.status()
    }
}
