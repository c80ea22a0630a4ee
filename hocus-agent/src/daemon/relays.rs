//! The loop's side of the relay between a multi-node job's daemons (docs/fanout.md):
//! the jobs whose prolog prefetch ran here with a node list, which nodes they have and
//! which files their profile names (what other nodes may fetch from here, and nothing
//! else), and this node's parent in the job's tree, which its copies come from first
//! and which vouches for its job starts' checks.
//! `Relays` owns that state; the loop asks the keeper whether a copy is held.

use std::{
    collections::HashSet,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    cache::relay::Parent,
    control::{
        messages::{Answer, JobNodes},
        refusal::Refusal,
        relay::NOT_KNOWN_YET,
    },
    profile::format::{Holder, Profile},
    shared::{relay, settings::Settings},
};

/// Jobs served to other nodes at once: the oldest is forgotten first.
const MAX_RELAYED: usize = 64;
/// How long a job's files are served after its prolog.
const SERVED_FOR: Duration = Duration::from_secs(3600);
/// How long a job's files are served to any node after its epilog saved its profile
/// here (the next day's job of the same profile still finds them).
const HELD_FOR: Duration = Duration::from_secs(24 * 3600);
/// How long a job's prolog may take to read its profile before the job's files are
/// asked for here: past it, none are served.
const READ_WITHIN: Duration = Duration::from_secs(60);
/// How long the parent's name may take to resolve.
const RESOLVE: Duration = Duration::from_secs(2);

struct Relayed {
    job_id: u32,
    me: String,
    nodes: HashSet<String>,
    /// None until its prolog here has read its profile.
    files: Option<HashSet<String>>,
    since: Instant,
    /// How long after `since` it is served.
    lasts: Duration,
    /// Its epilog saved its profile here, naming this node: any node's daemon may fetch
    /// its files (a later job's), not only its own nodes.
    held: bool,
    /// This node's parent in the job's tree: its copies come from there first, and it
    /// vouches for this node's job-start checks.
    parent: Option<Arc<Parent>>,
}

#[derive(Default)]
pub struct Relays {
    jobs: Vec<Relayed>,
}

impl Relays {
    /// A job's prolog with `nodes` began: its nodes may ask this node for it, and once
    /// its `profile` is read, fetch that profile's files from here. The parent node this
    /// node copies from first, if any (the same for the job's prolog, once found).
    pub async fn add(
        &mut self,
        nodes: &JobNodes,
        profile: Option<&Profile>,
        settings: &Settings,
    ) -> Option<Arc<Parent>> {
        let port = settings.relay_port()?;
        let me = nodes.nodes.iter().position(|n| *n == nodes.me)?;
        let files = profile.map(|p| p.files.iter().map(|f| f.path.clone()).collect());
        if let Some(job) = self
            .jobs
            .iter_mut()
            .find(|r| r.job_id == nodes.job_id && r.lives())
        {
            if files.is_some() {
                job.files = files;
            }
            return job.parent.clone();
        }
        self.push(Relayed {
            job_id: nodes.job_id,
            me: nodes.me.clone(),
            nodes: nodes.nodes.iter().cloned().collect(),
            files,
            since: Instant::now(),
            lasts: SERVED_FOR,
            held: false,
            parent: None,
        });
        let relays = &mut self.jobs;
        let parent = &nodes.nodes[relay::parent(me, settings.fanout_width())?];
        let addr = match resolve(parent, port).await {
            Ok(a) => a,
            Err(e) => {
                log::warn!(
                    "Slurm job {}: cannot find node {parent}'s address ({e}): this node reads the job's files from the network",
                    nodes.job_id
                );
                return None;
            }
        };
        log::info!(
            "Slurm job {}: node {} fetches its files from node {parent} ({addr}) first",
            nodes.job_id,
            nodes.me
        );
        let parent = Arc::new(Parent::new(
            parent.clone(),
            addr,
            relay::payload(nodes.job_id, &nodes.me, parent),
            settings.munge_socket.clone(),
            settings.relay_timeout(),
        ));
        if let Some(job) = relays.last_mut() {
            job.parent = Some(parent.clone());
        }
        Some(parent)
    }

    /// Where a prolog's prefetch of `profile` copies from first: this node's parent in
    /// its job's tree (the job made known with its files), else, with no parent (its
    /// first node, a job of one node), the node that held the files as the profile was
    /// saved, if it names one; `node` is this node's name.
    pub async fn copies_from(
        &mut self,
        (relay, holder, node): (Option<&JobNodes>, Option<&Holder>, Option<&str>),
        profile: &Profile,
        settings: &Settings,
    ) -> Option<Arc<Parent>> {
        if let Some(nodes) = relay {
            if let Some(parent) = self.add(nodes, Some(profile), settings).await {
                return Some(parent);
            }
        }
        self.holder(holder?, node?, settings).await
    }

    /// Slurm job `job_id`'s epilog on this node (`me`) saves its profile of `files`: any
    /// node's daemon may fetch those from here for a day (a later job of the profile:
    /// an array's tasks, the next job, a rebooted node), each checked as the job's own
    /// nodes' are. False when the relay is off.
    pub fn hold(&mut self, job_id: u32, me: &str, files: Vec<String>, settings: &Settings) -> bool {
        if settings.relay_port().is_none() {
            return false;
        }
        let nodes = self
            .relayed(job_id)
            .map(|j| j.nodes.clone())
            .unwrap_or_default();
        self.push(Relayed {
            job_id,
            me: me.to_owned(),
            nodes,
            files: Some(files.into_iter().collect()),
            since: Instant::now(),
            lasts: HELD_FOR,
            held: true,
            parent: None,
        });
        true
    }

    /// Where a prolog's copies come from first when this node (`me`) has no parent in
    /// its job's tree: the node that held them as the profile was saved, asked as that
    /// job's (a profile's hint, which the user may have written: the node proves itself,
    /// and each file is checked as a parent's is).
    pub async fn holder(
        &self,
        holder: &Holder,
        me: &str,
        settings: &Settings,
    ) -> Option<Arc<Parent>> {
        let port = settings.relay_port()?;
        if holder.node == me || holder.node.is_empty() {
            return None;
        }
        let addr = match resolve(&holder.node, port).await {
            Ok(a) => a,
            Err(e) => {
                log::warn!(
                    "the profile names node {} as holding its files, but its address is not found ({e}): this node reads them from the network",
                    holder.node
                );
                return None;
            }
        };
        log::info!(
            "node {me} fetches the profile's files from node {} ({addr}) first, which held them as Slurm job {} ended",
            holder.node,
            holder.job
        );
        Some(Arc::new(Parent::new(
            holder.node.clone(),
            addr,
            relay::held_payload(holder.job, me, &holder.node),
            settings.munge_socket.clone(),
            settings.relay_timeout(),
        )))
    }

    /// Adds a job, its earlier entry (if any) replaced; the oldest goes when full.
    fn push(&mut self, job: Relayed) {
        let relays = &mut self.jobs;
        relays.retain(|r| r.job_id != job.job_id && r.lives());
        if relays.len() >= MAX_RELAYED {
            relays.remove(0);
        }
        relays.push(job);
    }

    /// Slurm job `job_id`'s prolog failed here: its nodes may not ask for it.
    pub fn forget(&mut self, job_id: u32) {
        self.jobs.retain(|r| r.job_id != job_id);
    }

    /// This node's parent in Slurm job `job_id`'s tree, if it has one.
    pub fn parent_of(&self, job_id: u32) -> Option<Arc<Parent>> {
        self.relayed(job_id)?.parent.clone()
    }

    /// Whether node `from` may ask this node to vouch for its starts of `job_id`.
    pub fn may_vouch(&self, job_id: u32, from: &str) -> Result<(), Refusal> {
        match self.relayed(job_id) {
            Some(job) if job.nodes.contains(from) && from != job.me => Ok(()),
            _ => Err(Refusal::new(
                "relay_refused",
                format!("node {from} may not ask for Slurm job {job_id}'s checks"),
            )),
        }
    }

    /// Node `from` asks to fetch `job_id`'s files from this node, which it calls `to`:
    /// as one of the job's nodes, or (`held`) what the job left here for later jobs.
    pub fn join(&self, job_id: u32, from: &str, to: &str, held: bool) -> Answer {
        let Some(job) = self.relayed(job_id) else {
            return Refusal::new(
                NOT_KNOWN_YET,
                format!(
                    "Slurm job {job_id} is not known here (no prolog of it ran on this node, nor did its epilog save its profile here within {} hours)",
                    HELD_FOR.as_secs() / 3600
                ),
            )
            .into();
        };
        let refuse = |message: String| Refusal::new("relay_refused", message).into();
        if to != job.me {
            refuse(format!(
                "the credential is for node {to}; this is node {}",
                job.me
            ))
        } else if from == job.me || !job.may_ask(from, held) {
            refuse(format!("node {from} is not one of Slurm job {job_id}'s"))
        } else {
            Answer::Ready
        }
    }

    /// Whether node `from` of the job (or, `held`, any node) may fetch `source` from
    /// here: refused, or whether the job's profile names it (only then is the keeper
    /// asked for its copy); None while its prolog here has not read it yet.
    pub fn may_fetch(
        &self,
        job_id: u32,
        from: &str,
        source: &str,
        held: bool,
    ) -> Result<Option<bool>, Refusal> {
        let Some(job) = self.relayed(job_id).filter(|j| j.may_ask(from, held)) else {
            return Err(Refusal::new(
                "relay_refused",
                format!("node {from} may not fetch Slurm job {job_id}'s files"),
            ));
        };
        match &job.files {
            Some(files) => Ok(Some(files.contains(source))),
            // A prolog that never told what it read serves nothing.
            None if job.since.elapsed() > READ_WITHIN => Ok(Some(false)),
            None => Ok(None),
        }
    }

    fn relayed(&self, job_id: u32) -> Option<&Relayed> {
        self.jobs.iter().find(|r| r.job_id == job_id && r.lives())
    }
}

impl Relayed {
    fn lives(&self) -> bool {
        self.since.elapsed() < self.lasts
    }

    /// Whether node `from` may fetch this job's files: as one of its nodes, or (`held`)
    /// any node, once its profile was saved here.
    fn may_ask(&self, from: &str, held: bool) -> bool {
        if held {
            self.held
        } else {
            self.nodes.contains(from)
        }
    }
}

/// `node`'s address: its name through the resolver (/etc/hosts, DNS), as Slurm's
/// `NodeAddr` usually is.
async fn resolve(node: &str, port: u16) -> std::io::Result<SocketAddr> {
    let found = tokio::time::timeout(RESOLVE, tokio::net::lookup_host((node, port)))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
    let mut found: Vec<SocketAddr> = found.collect();
    // IPv4 first: the relay listens on every IPv4 address.
    found.sort_by_key(|a| !a.is_ipv4());
    found
        .into_iter()
        .next()
        .ok_or_else(|| std::io::Error::other("no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(relay_port: u16) -> Settings {
        Settings {
            relay_port: Some(relay_port),
            ..Settings::default()
        }
    }

    #[test]
    fn a_saved_jobs_files_go_to_any_node_but_its_checks_only_to_its_own() {
        let mut relays = Relays::default();
        let files = vec!["/net/env/a.py".to_owned()];
        assert!(!relays.hold(7, "node1", files.clone(), &settings(0)));
        assert!(relays.hold(7, "node1", files, &settings(9743)));
        // node9 never ran job 7: a later job's node takes the files it left here, asked
        // for as such, not as one of the job's nodes.
        assert!(matches!(
            relays.join(7, "node9", "node1", true),
            Answer::Ready
        ));
        assert!(matches!(
            relays.join(7, "node9", "node1", false),
            Answer::Refused(_)
        ));
        let fetch = |source| relays.may_fetch(7, "node9", source, true);
        assert_eq!(fetch("/net/env/a.py"), Ok(Some(true)));
        assert_eq!(fetch("/etc/shadow"), Ok(Some(false)));
        assert!(
            relays
                .may_fetch(7, "node9", "/net/env/a.py", false)
                .is_err()
        );
        // Not for another node's name, nor by this node itself, nor another job.
        assert!(matches!(
            relays.join(7, "node9", "node2", true),
            Answer::Refused(_)
        ));
        assert!(matches!(
            relays.join(7, "node1", "node1", true),
            Answer::Refused(_)
        ));
        assert!(matches!(
            relays.join(8, "node9", "node1", true),
            Answer::Refused(r) if r.reason == NOT_KNOWN_YET
        ));
        // Its job-start checks are vouched for its own nodes only.
        assert!(relays.may_vouch(7, "node9").is_err());
        // A job whose prolog ran here but whose profile was not saved here: its own
        // nodes only.
        let nodes = JobNodes {
            job_id: 9,
            nodes: vec!["node1".into(), "node2".into()],
            me: "node1".into(),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(relays.add(&nodes, Some(&Profile::default()), &settings(9743)));
        assert!(matches!(
            relays.join(9, "node2", "node1", false),
            Answer::Ready
        ));
        assert!(matches!(
            relays.join(9, "node9", "node1", true),
            Answer::Refused(_)
        ));
    }
}
